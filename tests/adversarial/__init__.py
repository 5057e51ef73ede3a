"""The standing adversarial suite (issue 53): `pagellm serve` under what an adversary, a careless client or
a hostile host does to it. Every server test here is marked slow and runs in CI (scripts/test.sh runs the
whole of tests/); the directory takes about four minutes on two CPU cores.

Most tests share one server (conftest.py: `adversary`), started as an exposed deployment would be: an API
key, the LoRA admin routes on, a small capacity (8 sequences admitted, 8 requests waiting, a 3 s queue
timeout: probes.ADMISSION_FLAGS) and a chat template that uses variables a request may set. Each test
leaves it settled (nothing running, waiting or admitted, no KV block held: probes.wait_settled) and
serving normally (probes.assert_serves_normally), with no fault in its log.

What is covered, and where (here, then elsewhere in tests/):

* Bad requests on every route get a 4xx in the route's error shape, never a 5xx, and the server serves
  normally afterwards. test_catalogue.py: Responses, Messages (Anthropic's shape), embeddings, the
  tokenizer, model, probe and metrics routes, the LoRA admin routes, wrong methods and keys, template
  and grammar attacks. test_validation_catalogue.py: chat and completions fields, bodies, limits;
  test_schema_fuzz.py: schemathesis on every route, strings for booleans and numbers.
* Overload with bounded concurrency: a complete 200 or a prompt 503 with Retry-After, no hang.
  test_overload.py: 64 clients on every generation route, /health latency, the turned-away counters.
  test_server_reliability.py: a 10x burst on one route; test_admission.py: each admission rule.
* Clients cut at random points leave no KV block and nothing in flight. test_cuts.py: seeded cuts after
  events, mid-event, before the headers, mid-generation, on every route. test_storms.py: cut streams on
  a cache that keeps preempting; test_server.py: disconnects.
* The engine core killed (SIGKILL) or stopped (SIGSTOP) under load: prompt 503s, exit status 1, no
  orphan process. test_signals.py. test_server_reliability.py: each failure alone, how fast /health
  notices; test_distributed_faults.py: a stopped rank, mp and Ray.
* SIGTERM under load: drained, or cut with a 503; exit status 0, no orphan, no traceback.
  test_signals.py. test_server_reliability.py: one stream, --shutdown-timeout.
* RSS bounded after bursts of large valid bodies. test_rss.py. test_admission.py: huge bodies refused,
  one at a time.
* A mixed soak with cuts and overload: no 5xx but the turn-aways, no leak. test_soak.py
  (benchmarks/soak.py for $PAGELLM_ADVERSARIAL_SOAK_S seconds). test_soak_smoke.py: the script alone.
* Security: the chat-template sandbox, no file read or URL fetched through any request field, the admin
  routes off by default and under the key, CORS closed, the key never logged. test_security.py (its
  docstring says what a caller with the key may load). test_lora_server.py: the admin routes absent by
  default; test_server_reliability.py: the key at the info log level.

Beside the suite, benchmarks/adversarial_catalogue.py generates hundreds of other bad requests from the
server's OpenAPI schema (wrong types, values past stated bounds, misspelt fields) and records a run under
benchmarks/results/; docs/deployment.md#security says what is closed by default.
"""
