"""Reads CloudEvents that outbox's publishers sent to a real broker, with the broker's
own Python client and the official CloudEvents SDK for Python (PyPI `cloudevents`),
and prints one JSON line per message: the decoded attributes and data, the raw header
names, or the decoder's error. tests/tests/cloudevents_interop.rs runs it and asserts.

    python cloudevents_decode.py kafka BROKERS TOPIC COUNT
    python cloudevents_decode.py nats|nats-structured URL STREAM COUNT
    python cloudevents_decode.py rabbitmq-amqp|rabbitmq-knative URL QUEUE COUNT

Decoders (cloudevents 2.x, `cloudevents.core.bindings`):
- kafka: `kafka.from_binary` (the Kafka binding 1.0.2, `ce_` headers);
- nats: the SDK has no NATS binding; the draft's binary mode (NATS binding 1.0.3-wip,
  section 3.1.3) is the HTTP binding's header mapping (`ce-` names, percent-encoded
  values), so `http.from_binary` reads it, and `ce-datacontenttype` is printed raw;
- nats-structured: the released NATS binding 1.0.2 (structured mode): the payload is a
  JSON event, read by the SDK's `JSONFormat().read`;
- rabbitmq-amqp: `amqp.from_binary` (the AMQP binding; it reads `cloudEvents:` and
  `cloudEvents_`), the pika header table as the application properties;
- rabbitmq-knative: `rabbitmq.from_binary` (Knative's RabbitMQ binding, `ce-` only).
"""

import asyncio
import json
import sys

import brokers as brokers_

from cloudevents.core.bindings import amqp, http, kafka, rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent


def text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def emit(decode, headers):
    """Prints the event `decode()` returns, or its error, with the header names."""
    line = {"headers": {k: text(v) for k, v in headers.items()}}
    try:
        event = decode()
        attributes = {}
        for name, value in event.get_attributes().items():
            attributes[name] = value.isoformat() if hasattr(value, "isoformat") else value
        line["attributes"] = attributes
        line["data"] = event.get_data()
    except Exception as e:  # the decoder's refusal is the result
        line["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(line, default=str), flush=True)


def read_kafka(brokers, topic, count):
    for headers, record in brokers_.kafka_records(brokers, topic, count):
        message = kafka.KafkaMessage(headers=headers, key=record.key, value=record.value)
        emit(lambda: kafka.from_binary(message, JSONFormat(), CloudEvent), headers)


async def read_nats(url, stream, count, structured):
    for headers, raw in await brokers_.nats_messages(url, stream, count):
        if structured:
            emit(lambda: JSONFormat().read(CloudEvent, raw.data), headers)
        else:
            message = http.HTTPMessage(headers=headers, body=raw.data)
            emit(lambda: http.from_binary(message, JSONFormat(), CloudEvent), headers)


def read_rabbitmq(binding, url, queue, count):
    for headers, properties, body in brokers_.rabbitmq_messages(url, queue, count):
        if binding == "rabbitmq-amqp":
            message = amqp.AMQPMessage(
                properties={"content-type": properties.content_type},
                application_properties=headers,
                application_data=body,
            )
            decode = lambda: amqp.from_binary(message, JSONFormat(), CloudEvent)
        else:
            message = rabbitmq.RabbitMQMessage(
                headers={k: text(v) for k, v in headers.items()},
                content_type=properties.content_type,
                body=body,
            )
            decode = lambda: rabbitmq.from_binary(message, JSONFormat(), CloudEvent)
        emit(decode, headers)


def main():
    mode, address, name, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "kafka":
        read_kafka(address, name, count)
    elif mode in ("nats", "nats-structured"):
        asyncio.run(read_nats(address, name, count, mode == "nats-structured"))
    elif mode in ("rabbitmq-amqp", "rabbitmq-knative"):
        read_rabbitmq(mode, address, name, count)
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
