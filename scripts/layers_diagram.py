"""Draw pagellm's layers (the import-linter contract in pyproject.toml) and the imports between its
packages (read from the code with grimp) as an SVG: `docs/architecture.svg`.

    .venv/bin/python scripts/layers_diagram.py            # rewrite the picture
    .venv/bin/python scripts/layers_diagram.py --check    # exit 1 if it is out of date (CI)

Each row is a layer, top to bottom; a box is a package (or a top-level module); a line joins a
package to each package it imports, always one in a lower row (the contract holds).
"""
from __future__ import annotations

import argparse
import html
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "architecture.svg"

BOX_W, BOX_H, GAP_X, ROW_H, MARGIN = 150, 34, 24, 78, 20


def layers() -> list[list[str]]:
    """The layers contract's rows, top first, each a list of module names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [[name.strip() for name in row.replace(":", "|").split("|")] for row in contract["layers"]]


def package_edges(rows: list[list[str]]) -> set[tuple[str, str]]:
    """(importer, imported) between the diagram's boxes, from every import in the code."""
    graph = grimp.build_graph("pagellm", include_external_packages=False)
    boxes = [name for row in rows for name in row]

    def box_of(module: str) -> str | None:
        return next((b for b in boxes if module == b or module.startswith(b + ".")), None)

    edges = set()
    for module in graph.modules:
        source = box_of(module)
        for imported in graph.find_modules_directly_imported_by(module):
            target = box_of(imported)
            if source and target and source != target:
                edges.add((source, target))
    return edges


def render(rows: list[list[str]], edges: set[tuple[str, str]]) -> str:
    width = 2 * MARGIN + max(len(row) for row in rows) * (BOX_W + GAP_X) - GAP_X
    height = 2 * MARGIN + len(rows) * ROW_H
    centre: dict[str, tuple[float, float]] = {}
    boxes = []
    for r, row in enumerate(rows):
        row_w = len(row) * (BOX_W + GAP_X) - GAP_X
        x0 = (width - row_w) / 2
        y = MARGIN + r * ROW_H
        for i, name in enumerate(row):
            x = x0 + i * (BOX_W + GAP_X)
            centre[name] = (x + BOX_W / 2, y + BOX_H / 2)
            label = html.escape(name.removeprefix("pagellm."))
            boxes.append(f'<rect x="{x:.0f}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" class="box"/>'
                         f'<text x="{x + BOX_W / 2:.0f}" y="{y + BOX_H / 2 + 5:.0f}">{label}</text>')
    lines = []
    for source, target in sorted(edges):
        (x1, y1), (x2, y2) = centre[source], centre[target]
        lines.append(f'<line x1="{x1:.0f}" y1="{y1 + BOX_H / 2:.0f}" x2="{x2:.0f}" y2="{y2 - BOX_H / 2:.0f}"/>')
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'viewBox="0 0 {width:.0f} {height}" font-family="sans-serif" font-size="13">',
        "<style>.box{fill:#eef3fb;stroke:#3a5a8c} text{text-anchor:middle;fill:#1b2a41} "
        "line{stroke:#7a8aa0;stroke-opacity:0.35;stroke-width:1}</style>",
        '<rect width="100%" height="100%" fill="white"/>',
        *lines, *boxes, "</svg>", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/architecture.svg is out of date")
    ns = parser.parse_args(argv)
    rows = layers()
    svg = render(rows, package_edges(rows))
    if ns.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != svg:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run scripts/layers_diagram.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(svg)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
