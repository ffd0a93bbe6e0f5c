"""Decodes every record of a changelog topic with confluent-kafka's
AvroDeserializer. Usage: decode_all.py TOPIC COUNT. Prints
'<id> n_scaled=<value>' per change event and 'decoded N records'."""
import os
import sys
import time

from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

topic, want = sys.argv[1], int(sys.argv[2])
deserialize = AvroDeserializer(SchemaRegistryClient({"url": os.environ["PGCDC_REGISTRY_URL"]}))
consumer = Consumer({
    "bootstrap.servers": os.environ["PGCDC_KAFKA_BROKERS"],
    "group.id": f"decode-all-{os.getpid()}",
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
    value = deserialize(m.value(), SerializationContext(topic, MessageField.VALUE))
    row = value["after"]
    print(f"{key['id']} n_scaled={row['n_scaled']}")
    seen += 1
consumer.close()
print(f"decoded {seen} records")
sys.exit(0 if seen == want else 1)
