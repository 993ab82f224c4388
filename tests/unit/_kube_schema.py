"""A Kubernetes structural schema (a CRD's openAPIV3Schema) as plain JSON Schema, for the `jsonschema` package,
strict about field names as the API server is (cluster/kuberay/crd/README.md):

- `x-kubernetes-int-or-string`: type [integer, string];
- `nullable: true`: null allowed as well;
- `x-kubernetes-preserve-unknown-fields`: left open;
- any other object schema with `properties`: additionalProperties false, since the API server prunes unknown
  fields and `kubectl apply` with Strict field validation rejects them.

The other `x-kubernetes-*` keys (CEL validations, list and map types) are left in; jsonschema ignores them.

>>> s = to_json_schema({"type": "object", "properties": {
...     "port": {"x-kubernetes-int-or-string": True},
...     "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
...     "when": {"type": "string", "nullable": True}}})
>>> s["additionalProperties"], s["properties"]["port"]["type"], s["properties"]["when"]["type"]
(False, ['integer', 'string'], ['string', 'null'])
>>> "additionalProperties" in s["properties"]["free"]
False
"""

from __future__ import annotations

from typing import Any

#: keywords whose value is one schema / a list of schemas / a mapping of names to schemas
_ONE = ("items", "additionalProperties", "not")
_MANY = ("anyOf", "allOf", "oneOf")
_NAMED = ("properties",)


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A converted copy of `schema` (the input is left as it is)."""
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = to_json_schema(out[key])
    for key in _MANY:
        if key in out:
            out[key] = [to_json_schema(s) for s in out[key]]
    for key in _NAMED:
        if key in out:
            out[key] = {name: to_json_schema(s) for name, s in out[key].items()}
    if out.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if out.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out
