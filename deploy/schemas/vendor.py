"""Extract the OpenAPI schema of one kind from a published CustomResourceDefinition, small
enough to keep in the repository (deploy/schemas/README.md says which files came from where).

    python deploy/schemas/vendor.py CRD.yaml VERSION [--prune DOTTED.PATH ...] >> OUT.json

It prints {"apiVersion": ..., "kind": ..., "source": ..., "schema": ...} as one JSON line: the
CRD's openAPIV3Schema for that version, with its descriptions left out, and each pruned path
(properties named by dots) replaced by "any object". tests/test_deploy.py validates the
manifests of that kind against it with jsonschema, and what was pruned by other means (a
JobSet's Job template as a batch/v1 Job, with kubernetes-validate).

What it is not: a CRD installer or a full OpenAPI-to-JSON-Schema converter. The test reads the
x-kubernetes-* extensions it needs (int-or-string, preserved unknown fields) itself.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ANY_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def prune(schema: dict[str, Any], dotted: str) -> None:
    """Replace the schema at `dotted` (property names; `[]` steps into an array's items)."""
    node = schema
    *parents, last = dotted.split(".")
    for name in parents:
        node = node["items"] if name == "[]" else node["properties"][name]
    node["properties"][last] = ANY_OBJECT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("version")
    parser.add_argument("--source", required=True, help="Where the CRD came from, said in OUT.")
    parser.add_argument("--prune", action="append", default=[])
    args = parser.parse_args()
    crd = yaml.safe_load(args.crd.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == args.version]
    schema = without_descriptions(version["schema"]["openAPIV3Schema"])
    for dotted in args.prune:
        prune(schema, dotted)
    line = {
        "apiVersion": f"{crd['spec']['group']}/{args.version}",
        "kind": crd["spec"]["names"]["kind"],
        "source": args.source,
        "pruned": args.prune,
        "schema": schema,
    }
    sys.stdout.write(json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
