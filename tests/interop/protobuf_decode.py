"""Reads Protobuf events that outbox's publishers sent to a real broker, with the broker's
own Python client and Google's Protobuf runtime for Python (PyPI `protobuf`), and prints
one JSON line per message: its headers and the message decoded with the `.proto` schema
that the AsyncAPI document gives the event type, compiled by protoc (PyPI
`grpcio-tools`): no code of ours reads the schema or decodes the payload.
tests/tests/codecs.rs runs it and asserts.

    python protobuf_decode.py kafka BROKERS TOPIC COUNT DOCUMENT EVENT_TYPE
    python protobuf_decode.py nats URL STREAM COUNT DOCUMENT EVENT_TYPE
    python protobuf_decode.py rabbitmq URL QUEUE COUNT DOCUMENT EVENT_TYPE

DOCUMENT is the path of the AsyncAPI 3.0 document (JSON); the message whose
`x-outbox-event-type` is EVENT_TYPE has the schema, as AsyncAPI's multi-format schema
object (`schemaFormat: application/vnd.google.protobuf;version=3`, the `.proto` text);
its first message is the payload's.
"""

import asyncio
import json
import os
import sys
import tempfile

import brokers as brokers_

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.json_format import MessageToDict
from grpc_tools import protoc


def schema_of(document_path, event_type):
    return brokers_.payload_schema(document_path, event_type, "application/vnd.google.protobuf", "Protobuf")


def message_class(proto_text):
    """The class of the first message of `proto_text`, compiled by protoc."""
    with tempfile.TemporaryDirectory() as work:
        source = os.path.join(work, "event.proto")
        with open(source, "w") as f:
            f.write(proto_text)
        out = os.path.join(work, "event.pb")
        status = protoc.main(["protoc", f"-I{work}", f"--descriptor_set_out={out}", source])
        if status != 0:
            sys.exit(f"protoc refused the document's schema (exit {status}):\n{proto_text}")
        files = descriptor_pb2.FileDescriptorSet()
        with open(out, "rb") as f:
            files.ParseFromString(f.read())
    file = files.file[0]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    name = file.message_type[0].name
    full = f"{file.package}.{name}" if file.package else name
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full))


def text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def emit(cls, headers, body):
    line = {"headers": {k: text(v) for k, v in headers.items()}}
    try:
        decoded = cls()
        decoded.ParseFromString(bytes(body))
        line["message"] = MessageToDict(decoded, preserving_proto_field_name=True)
        line["reencoded_equal"] = decoded.SerializeToString(deterministic=True) == bytes(body)
    except Exception as e:  # the decoder's refusal is the result
        line["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(line, default=str), flush=True)


def read_kafka(cls, brokers, topic, count):
    for headers, record in brokers_.kafka_records(brokers, topic, count):
        emit(cls, headers, record.value)


async def read_nats(cls, url, stream, count):
    for headers, raw in await brokers_.nats_messages(url, stream, count):
        emit(cls, headers, raw.data)


def read_rabbitmq(cls, url, queue, count):
    for headers, properties, body in brokers_.rabbitmq_messages(url, queue, count):
        headers["content_type (property)"] = properties.content_type
        emit(cls, headers, body)


def main():
    mode, address, name, count, document, event_type = sys.argv[1:7]
    cls = message_class(schema_of(document, event_type))
    count = int(count)
    if mode == "kafka":
        read_kafka(cls, address, name, count)
    elif mode == "nats":
        asyncio.run(read_nats(cls, address, name, count))
    elif mode == "rabbitmq":
        read_rabbitmq(cls, address, name, count)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
