"""Reads Protobuf events that outbox's publishers sent to a real broker, with the broker's
own Python client and Google's Protobuf runtime for Python (PyPI `protobuf`), and prints
one JSON line per message: its headers and the message decoded with a descriptor built
here from the schema given on the command line (no code of ours decodes it).
tests/tests/codecs.rs runs it and asserts.

    python protobuf_decode.py kafka BROKERS TOPIC COUNT SCHEMA
    python protobuf_decode.py nats URL STREAM COUNT SCHEMA
    python protobuf_decode.py rabbitmq URL QUEUE COUNT SCHEMA

SCHEMA is JSON: {"package": "acme", "message": "OrderPlaced",
"fields": [["order_id", 1, "uint64"], ["customer", 2, "string"], ...]}.
"""

import asyncio
import json
import sys

import brokers as brokers_

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.json_format import MessageToDict

TYPES = {
    "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "uint32": descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
}


def message_class(schema):
    """The message class of `schema`, through a descriptor pool of its own."""
    file = descriptor_pb2.FileDescriptorProto(
        name="outbox_interop.proto", package=schema["package"], syntax="proto3"
    )
    message = file.message_type.add(name=schema["message"])
    for name, number, kind in schema["fields"]:
        message.field.add(
            name=name,
            number=number,
            type=TYPES[kind],
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    descriptor = pool.FindMessageTypeByName(f"{schema['package']}.{schema['message']}")
    return message_factory.GetMessageClass(descriptor)


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
    mode, address, name, count, schema = sys.argv[1:6]
    cls = message_class(json.loads(schema))
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
