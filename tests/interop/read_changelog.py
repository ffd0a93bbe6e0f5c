"""Reads a changelog topic with confluent-kafka's AvroDeserializer through
pgcdc's registry, as any consumer team would.

Usage: read_changelog.py TOPIC COUNT COLUMN. Prints one line per record
('<id> <op> <COLUMN>=<value>', or '<id> tombstone') and 'decoded N records';
exits non-zero unless COUNT records were decoded."""
import os
import sys
import time

from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

topic, want, column = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deserialize = AvroDeserializer(SchemaRegistryClient({"url": os.environ["PGCDC_REGISTRY_URL"]}))
consumer = Consumer({
    "bootstrap.servers": os.environ["PGCDC_KAFKA_BROKERS"],
    "group.id": f"interop-{os.getpid()}",
    "auto.offset.reset": "earliest",
    "enable.auto.commit": False,
})
consumer.subscribe([topic])
seen = 0
deadline = time.time() + 60
while seen < want and time.time() < deadline:
    m = consumer.poll(0.5)
    if m is None:
        continue
    if m.error():
        raise SystemExit(f"consumer error: {m.error()}")
    key = deserialize(m.key(), SerializationContext(topic, MessageField.KEY))
    seen += 1
    if m.value() is None:
        print(f"{key['id']} tombstone")
        continue
    value = deserialize(m.value(), SerializationContext(topic, MessageField.VALUE))
    row = value["after"] or value["before"]
    print(f"{key['id']} {value['op']} {column}={row[column]}")
consumer.close()
print(f"decoded {seen} records")
sys.exit(0 if seen == want else 1)
