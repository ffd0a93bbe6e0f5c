"""Python confluent-kafka[avro] against pgcdc's registry.

Run by tests/registry.rs with PGCDC_REGISTRY_URL and SUBJECT_PREFIX set.
Prints 'ok <step>' per step; any failure raises and exits non-zero.
"""
import json
import os
import sys

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

url = os.environ["PGCDC_REGISTRY_URL"]
prefix = os.environ["SUBJECT_PREFIX"]
client = SchemaRegistryClient({"url": url})

V1 = {
    "type": "record",
    "name": "Customer",
    "namespace": "demo",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": "string"},
        {"name": "tier", "type": ["null", "string"], "default": None},
    ],
}
V2 = dict(V1, fields=V1["fields"] + [{"name": "tenant_id", "type": ["null", "int"], "default": None}])
BROKEN = dict(V1, fields=[{"name": "id", "type": "string"}])

subject = f"{prefix}-customers-value"

schema_id = client.register_schema(subject, Schema(json.dumps(V1), "AVRO"))
again = client.register_schema(subject, Schema(json.dumps(V1, indent=2), "AVRO"))
assert schema_id == again, (schema_id, again)
print("ok register", schema_id)

found = client.lookup_schema(subject, Schema(json.dumps(V1), "AVRO"))
assert found.schema_id == schema_id and found.version == 1, found
print("ok lookup")

assert client.test_compatibility(subject, Schema(json.dumps(V2), "AVRO")) is True
assert client.test_compatibility(subject, Schema(json.dumps(BROKEN), "AVRO")) is False
print("ok compatibility")

fetched = client.get_schema(schema_id)
assert json.loads(fetched.schema_str) == V1, fetched.schema_str
latest = client.get_latest_version(subject)
assert latest.version == 1 and latest.schema_id == schema_id
print("ok get_schema")

topic = f"{prefix}-orders"
serializer = AvroSerializer(client, json.dumps(V2))
deserializer = AvroDeserializer(client)
record = {"id": 7, "name": "Ada", "tier": None, "tenant_id": 3}
ctx = SerializationContext(topic, MessageField.VALUE)
payload = serializer(record, ctx)
assert payload[0] == 0, "Confluent magic byte"
decoded = deserializer(payload, ctx)
assert decoded == record, decoded
registered = client.get_latest_version(f"{topic}-value")
assert int.from_bytes(payload[1:5], "big") == registered.schema_id
print("ok serde_round_trip")

client.register_schema(f"{topic}-value", Schema(json.dumps(V2), "AVRO"))
try:
    client.register_schema(f"{topic}-value", Schema(json.dumps(BROKEN), "AVRO"))
    raise AssertionError("an incompatible schema was accepted")
except SchemaRegistryError as e:
    assert e.http_status_code == 409 and e.error_code == 409, (e.http_status_code, e.error_code)
print("ok incompatible_refused")
sys.exit(0)
