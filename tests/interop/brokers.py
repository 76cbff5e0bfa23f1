"""What the interop decoders share: each broker's messages, read with the broker's own
Python client (kafka-python, nats-py, pika), as (headers, body) with the client's view
of the message for decoders that need more (a Kafka record, a pika properties object);
and an event type's payload schema from an AsyncAPI document.
"""

import json
import sys
import time


def payload_schema(document_path, event_type, schema_format, what):
    """The `schema` of the payload the AsyncAPI document (JSON) gives the message whose
    `x-outbox-event-type` is `event_type`; exits, saying why, when that message is
    missing or its `schemaFormat` does not start with `schema_format` (`what` names it)."""
    with open(document_path) as f:
        document = json.load(f)
    for message in document["components"]["messages"].values():
        if message.get("x-outbox-event-type") == event_type:
            payload = message.get("payload") or {}
            found = payload.get("schemaFormat", "(none)")
            if not found.startswith(schema_format):
                sys.exit(f"{event_type}: the payload's schemaFormat is {found}, not {what}")
            return payload["schema"]
    sys.exit(f"no message of event type {event_type} in {document_path}")


def kafka_records(brokers, topic, count, timeout=60):
    """The first `count` records of partition 0 of `topic`, from its start, without a
    consumer group: (headers as a dict of bytes, the record)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=brokers.split(","),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    partition = TopicPartition(topic, 0)
    consumer.assign([partition])
    consumer.seek_to_beginning(partition)
    seen = 0
    deadline = time.monotonic() + timeout
    try:
        while seen < count and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=1000).values():
                for record in records:
                    yield {name: value for name, value in record.headers}, record
                    seen += 1
    finally:
        consumer.close()


async def nats_messages(url, stream, count):
    """Messages 1..=count of JetStream stream `stream`: (headers, the raw message)."""
    import nats

    nc = await nats.connect(url)
    js = nc.jetstream()
    out = []
    for seq in range(1, count + 1):
        raw = await js.get_msg(stream, seq)
        out.append((dict(raw.headers or {}), raw))
    await nc.close()
    return out


def rabbitmq_messages(url, queue, count, timeout=60):
    """The first `count` messages of `queue`, taken (auto-acknowledged): (headers, the
    pika properties, the body)."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    seen = 0
    deadline = time.monotonic() + timeout
    try:
        while seen < count and time.monotonic() < deadline:
            method, properties, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                time.sleep(0.2)
                continue
            yield dict(properties.headers or {}), properties, body
            seen += 1
    finally:
        connection.close()
