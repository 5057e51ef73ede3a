"""A generated catalogue of bad requests, run once against `pagellm serve`: every request must get a 4xx in
its route's error shape naming the field at fault, and the server must then serve normally with nothing
left in flight.

The requests are variants of a valid body for each request model of the server's POST routes (the
server's own OpenAPI schema lists the models and their fields; tests/test_schema_fuzz.py gives a valid
body of each), each with one field made wrong:
* of another JSON type than the field takes: an array, an object, a boolean, a fraction or a number in
  place of what it takes (a string in place of a boolean or a number is tests/test_schema_fuzz.py's);
* past a bound the schema states (maximum + 1, minimum - 1, a string outside an enum);
* a misspelt field name (the name with a trailing underscore).
The embeddings request is left out: a server that generates refuses every embeddings request, so its
400s would say nothing of the fields. Requests equal to one of the standing catalogues'
(tests/test_validation_catalogue.py, tests/adversarial/test_catalogue.py) are left out too: this is a
catalogue beside the suite.

    .venv/bin/python -m benchmarks.adversarial_catalogue     # starts a server of the embedded model

The result (every request's route, field, variant and status; the failures) goes to
benchmarks/results/adversarial_catalogue_<UTC stamp>.json; the exit status is 0 only if every request got
a 4xx in its route's shape and the server served normally afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from pagellm.benchmarks.results import default_result_path, run_metadata, write_json
from pagellm.loader import default_model_path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the test helpers and catalogues import each other as top-level modules

from adversarial.probes import assert_serves_normally  # noqa: E402
from adversarial.test_catalogue import CATALOGUE as ADVERSARIAL_CATALOGUE  # noqa: E402
from server_utils import RemoteServer  # noqa: E402
from test_schema_fuzz import VALID_BODIES  # noqa: E402
from test_validation_catalogue import CATALOGUE as VALIDATION_CATALOGUE  # noqa: E402

SERVED_NAME = "smollm2"
SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20),
                "--max-model-len", "512", "--served-model-name", SERVED_NAME)
WRONG_TYPES = {"array": [7], "object": {"v": 7}, "boolean": True, "fraction": 7.5, "integer": 7}
"""A value of each JSON type (a fraction is a number that no integer field takes), in place of a field's."""
LEFT_OUT = ("EmbeddingRequest",)
"""Refused whole by a server that generates: its variants' 400s would say nothing of its fields."""
TIMEOUT_S = 60.0
LOG_CHARS = 50 << 20


def variants(schema: dict, name: str, valid: dict) -> list[tuple[str, str, dict]]:
    """(field, variant, body) for each field of the request model `name` made wrong one way at a time."""
    components = schema["components"]["schemas"]
    found = []
    for field, prop in components[name]["properties"].items():
        branches = [_resolved(branch, components) for branch in prop.get("anyOf", prop.get("oneOf", [prop]))]
        types = {branch.get("type") for branch in branches} - {"null"}
        if not types or None in types:
            continue  # a field of any value: nothing is of the wrong type
        for kind, value in WRONG_TYPES.items():
            if not _takes(types, kind):
                found.append((field, f"{kind} in place of {'/'.join(sorted(types))}", {**valid, field: value}))
        for branch in branches:
            if isinstance(branch.get("maximum"), (int, float)) and branch.get("type") in ("integer", "number"):
                found.append((field, "maximum + 1", {**valid, field: branch["maximum"] + 1}))
            if isinstance(branch.get("minimum"), (int, float)) and branch.get("type") in ("integer", "number"):
                found.append((field, "minimum - 1", {**valid, field: branch["minimum"] - 1}))
            if isinstance(branch.get("enum"), list) and all(isinstance(v, str) for v in branch["enum"]):
                found.append((field, "outside the enum", {**valid, field: "not-one-of-them"}))
        found.append((field, "misspelt", {**valid, f"{field}_": valid.get(field, 1)}))
    return found


def _resolved(branch: dict, components: dict) -> dict:
    ref = branch.get("$ref")
    return components[ref.rsplit("/", 1)[1]] if ref else branch


def _takes(types: set[str], kind: str) -> bool:
    """Whether a field of JSON `types` takes a value of `kind` (an integer is also a number)."""
    if kind == "fraction":
        return "number" in types
    if kind == "integer":
        return bool({"integer", "number"} & types)
    return kind in types


def suite_requests() -> set[tuple[str, str]]:
    """(route, canonical JSON body) of the standing catalogues' requests."""
    return {(case.path, json.dumps(case.body, sort_keys=True)) for case in (*VALIDATION_CATALOGUE,
                                                                          *ADVERSARIAL_CATALOGUE)
            if isinstance(case.body, (dict, list))}


def refusal_problem(path: str, field: str, response: httpx.Response) -> str | None:
    """What is wrong with a refusal: not a 4xx, not in the route's error shape, or not naming the field
    (its `param`, or its message in Anthropic's shape, which has no param)."""
    if not 400 <= response.status_code < 500:
        return f"HTTP {response.status_code}"
    try:
        body = response.json()
    except ValueError:
        return "not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "no error object"
    if path.startswith("/v1/messages"):
        ok = body.get("type") == "error" and set(error) == {"type", "message"} and body.get("request_id")
        named = field in error.get("message", "")
    else:
        ok = set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
        named = field in (error.get("param") or "") or field in error.get("message", "")
    if not ok:
        return f"not the route's error shape: {response.text[:200]}"
    return None if named else f"does not name {field!r}: {response.text[:200]}"


def run(server: RemoteServer) -> dict[str, Any]:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=TIMEOUT_S).json()
    in_suite = suite_requests()
    requests, left_out = [], 0
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:  # the bodies the variants start from
        statuses = {name: http.post(path, json=body).status_code for name, (path, body) in VALID_BODIES.items()
                   if name not in LEFT_OUT}
    assert set(statuses.values()) == {200}, f"a valid body was refused: {statuses}"
    for name, (path, valid) in VALID_BODIES.items():
        if name in LEFT_OUT:
            continue
        for field, variant, body in variants(schema, name, valid):
            if (path, json.dumps(body, sort_keys=True)) in in_suite:
                left_out += 1
            else:
                requests.append({"route": path, "model": name, "field": field, "variant": variant, "body": body})
    failures = []
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        for request in requests:
            response = http.post(request["route"], json=request["body"])
            request["status"] = response.status_code
            field = request["field"] + "_" if request["variant"] == "misspelt" else request["field"]
            problem = refusal_problem(request["route"], field, response)
            if problem is not None:
                failures.append({**request, "problem": problem})
    try:
        assert_serves_normally(server)
        serves_normally = True
    except AssertionError as e:
        serves_normally, failures = False, [*failures, {"problem": f"not serving normally after: {e}"}]
    return {
        "num_requests": len(requests),
        "num_left_out_as_in_suite": left_out,
        "by_status": dict(Counter(r["status"] for r in requests)),
        "by_route": dict(Counter(r["route"] for r in requests)),
        "by_variant": dict(Counter(r["variant"].split(" in place of")[0] for r in requests)),
        "num_failures": len(failures),
        "failures": failures,
        "serves_normally_after": serves_normally,
        "requests": [{k: v for k, v in r.items() if k != "body"} | {"body": json.dumps(r["body"])[:300]}
                     for r in requests],
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    server = RemoteServer(args.model or default_model_path(), *SERVER_FLAGS)
    try:
        report = run(server)
        log = server.log_tail(LOG_CHARS)
        report["server_log_faults"] = [line for line in log.splitlines()
                                       if "Traceback" in line or " 500 " in line or "-> 500" in line][:50]
    finally:
        report["server_exit_code"] = server.stop()
    passed = (report["num_failures"] == 0 and report["serves_normally_after"] and not report["server_log_faults"]
              and report["server_exit_code"] == 0)
    payload = {"benchmark": "adversarial_catalogue", **run_metadata(), "parameters": vars(args), "passed": passed,
               **report}
    print(f"{report['num_requests']} bad requests ({report['num_left_out_as_in_suite']} more left out as the "
          f"suite's): by status {report['by_status']}; {report['num_failures']} failures; served normally "
          f"after: {report['serves_normally_after']}; server exit {report['server_exit_code']}")
    for failure in report["failures"][:20]:
        print("failure:", json.dumps(failure)[:400])
    print("wrote", write_json(payload, args.output or default_result_path("adversarial_catalogue")))
    return 0 if passed else 1


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--output", default=None,
                   help="result path; default benchmarks/results/adversarial_catalogue_<UTC stamp>.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
