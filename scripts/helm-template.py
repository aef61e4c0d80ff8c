#!/usr/bin/env python3
"""`helm lint` and `helm template` for a chart, offline, without the helm
binary: through the Helm SDK of PyPI's helm-python-sdk (the Helm engine as
a library). Prints every rendered manifest (NOTES.txt left out) separated by
`---`; exits 1 on a lint error or a template that does not render.

    helm-template.py CHART [--name NAME] [--namespace NS] [--set KEY=VALUE]...
"""
import argparse
import sys

from helm_python import chart


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("chart")
    p.add_argument("--name", default="release")
    p.add_argument("--namespace", default="default")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    values: dict = {}
    for s in a.set:
        key, _, value = s.partition("=")
        node = values
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = {"true": True, "false": False}.get(value, value)
    report = chart.lint(a.chart, values, strict=True, namespace=a.namespace)
    bad = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    if bad:
        for m in bad:
            print(f"{a.chart}: {m.get('path', '')}: {m['error']}", file=sys.stderr)
        return 1
    rendered = chart.Chart.load(a.chart).render(values, name=a.name, namespace=a.namespace, is_install=True)
    for path in sorted(rendered):
        if path.endswith("NOTES.txt") or not rendered[path].strip():
            continue
        print(f"---\n# Source: {path}\n{rendered[path].strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
