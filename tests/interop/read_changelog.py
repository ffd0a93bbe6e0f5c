"""Reads a changelog topic with confluent-kafka's AvroDeserializer through
pgcdc's registry, as any consumer team would.

Usage: read_changelog.py TOPIC COUNT. Prints one line per change event
('<id> <op> amount=<amount>') and 'decoded N records'."""
import os
import sys
import time

from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

topic, want = sys.argv[1], int(sys.argv[2])
registry = SchemaRegistryClient({"url": os.environ["PGCDC_REGISTRY_URL"]})
deserialize = AvroDeserializer(registry)
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
    assert value["source"]["table"] == "orders", value["source"]
    print(f"{key['id']} {value['op']} amount={row['amount']}")
consumer.close()
print(f"decoded {seen} records")
sys.exit(0 if seen == want else 1)
