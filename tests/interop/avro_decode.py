"""Reads Avro events that outbox's publishers sent to a real broker, with the broker's
own Python client and fastavro (PyPI `fastavro`), and prints one JSON line per message:
its headers and the record decoded with the writer schema that the AsyncAPI document
gives the event type (no code of ours decodes it).
tests/tests/codecs.rs runs it and asserts.

    python avro_decode.py kafka BROKERS TOPIC COUNT DOCUMENT EVENT_TYPE
    python avro_decode.py nats URL STREAM COUNT DOCUMENT EVENT_TYPE
    python avro_decode.py rabbitmq URL QUEUE COUNT DOCUMENT EVENT_TYPE

DOCUMENT is the path of the AsyncAPI 3.0 document (JSON); the message whose
`x-outbox-event-type` is EVENT_TYPE has the schema, as AsyncAPI's multi-format schema
object (`schemaFormat: application/vnd.apache.avro+json;version=1.9.0`).

Each payload is Avro's single-object encoding: C3 01, the CRC-64-AVRO fingerprint of the
writer schema (8 bytes, little-endian), the binary datum. The line says whether the
fingerprint is the one fastavro computes for the document's schema.
"""

import asyncio
import io
import json
import sys

import brokers as brokers_

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form


def schema_of(document_path, event_type):
    return brokers_.payload_schema(document_path, event_type, "application/vnd.apache.avro", "Avro")


def text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def emit(schema, expected_fingerprint, headers, body):
    body = bytes(body)
    line = {"headers": {k: text(v) for k, v in headers.items()}}
    try:
        if body[:2] != b"\xc3\x01":
            raise ValueError(f"no single-object marker: {body[:2].hex()}")
        line["fingerprint"] = body[2:10].hex()
        line["fingerprint_matches"] = line["fingerprint"] == expected_fingerprint
        line["record"] = fastavro.schemaless_reader(io.BytesIO(body[10:]), schema)
        out = io.BytesIO()
        fastavro.schemaless_writer(out, schema, line["record"])
        line["reencoded_equal"] = out.getvalue() == body[10:]
    except Exception as e:  # the decoder's refusal is the result
        line["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(line, default=str), flush=True)


def main():
    mode, address, name, count, document, event_type = sys.argv[1:7]
    schema = fastavro.parse_schema(schema_of(document, event_type))
    # fastavro's CRC-64-AVRO, as hex of the little-endian bytes a payload carries
    # (the specification's fingerprint of "null", 0x63dd24e7cc258f8a, is 8a8f25cce724dd63).
    expected = fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO")
    count = int(count)
    if mode == "kafka":
        for headers, record in brokers_.kafka_records(address, name, count):
            emit(schema, expected, headers, record.value)
    elif mode == "nats":
        for headers, raw in asyncio.run(brokers_.nats_messages(address, name, count)):
            emit(schema, expected, headers, raw.data)
    elif mode == "rabbitmq":
        for headers, properties, body in brokers_.rabbitmq_messages(address, name, count):
            headers["content_type (property)"] = properties.content_type
            emit(schema, expected, headers, body)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
