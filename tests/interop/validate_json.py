"""Validates a JSON document against a JSON Schema (draft 2020-12) with the
`jsonschema` package, a validator independent of pgcdc.

usage: validate_json.py SCHEMA DOCUMENT; prints each error, exits 1 on any.
"""
import json
import sys

import jsonschema

schema = json.load(open(sys.argv[1]))
document = json.load(open(sys.argv[2]))
jsonschema.Draft202012Validator.check_schema(schema)
errors = sorted(
    jsonschema.Draft202012Validator(schema).iter_errors(document),
    key=lambda e: list(e.absolute_path),
)
for e in errors:
    print("/".join(str(p) for p in e.absolute_path) or "(root)", ":", e.message)
sys.exit(1 if errors else 0)
