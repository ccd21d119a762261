"""Validates Kubernetes custom resources against a CustomResourceDefinition's openAPIV3Schema
(JSON Schema; the x-kubernetes-* extensions and CEL rules are not evaluated here).

    crd_validate.py CRD.yaml MANIFEST.yaml...

Prints `valid: Kind/name` per resource of the CRD's kind; exits 1 with the errors otherwise.
Run by tests/e2e/tests/deploy_manifests.rs with the project venv (jsonschema, PyYAML).
"""
import sys

import jsonschema
import yaml


def main() -> int:
    crd = yaml.safe_load(open(sys.argv[1]))
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schemas = {f"{group}/{v['name']}": v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]}
    failed = False
    for path in sys.argv[2:]:
        for doc in yaml.safe_load_all(open(path)):
            if not doc or doc.get("kind") != kind:
                continue
            name = doc.get("metadata", {}).get("name", "?")
            schema = schemas.get(doc.get("apiVersion"))
            if schema is None:
                print(f"invalid: {kind}/{name}: apiVersion {doc.get('apiVersion')} is not served by the CRD")
                failed = True
                continue
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
            for e in errors:
                print(f"invalid: {kind}/{name}: {'.'.join(map(str, e.path)) or '(root)'}: {e.message}")
            failed |= bool(errors)
            if not errors:
                print(f"valid: {kind}/{name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
