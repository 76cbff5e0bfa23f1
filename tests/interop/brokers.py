"""What the interop decoders share: each broker's messages, read with the broker's own
Python client (kafka-python, nats-py, pika), as (headers, body) with the client's view
of the message for decoders that need more (a Kafka record, a pika properties object).
"""

import time


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
