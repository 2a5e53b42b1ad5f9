"""A gRPC client nobody in this project wrote (grpcio), for tests/tests/grpc.rs.

Reads a JSON list of calls from argv[2] and makes them, one after the other, on one channel to
argv[1] whose service config retries UNAVAILABLE and ABORTED (gRFC A6, honouring the server's
grpc-retry-pushback-ms). Prints one JSON line per call: the final status code, the receipt
decoded from the answer, and whether the answer was marked idempotent-replayed (in its initial
metadata, or in the trailing metadata of a trailers-only error answer).

A call is {"key": str|null, "request_id": str, "user": str, "amount": int, "behaviour": str,
"messages": 1|2}; the PayRequest is encoded here by hand (protobuf wire format), so the test
needs no generated Python code.
"""

import json
import sys

import grpc

PAY = "/payments.Payments/Pay"

SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": "payments.Payments"}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"],
            },
        }
    ]
}


def varint(value):
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def string_field(number, text):
    data = text.encode()
    return varint(number << 3 | 2) + varint(len(data)) + data


def pay_request(call):
    return (
        string_field(1, call["request_id"])
        + string_field(2, call["user"])
        + varint(3 << 3) + varint(call["amount"])
        + string_field(4, call["behaviour"])
    )


def read_varint(data, at):
    value, shift = 0, 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def receipt(data):
    fields, at = {}, 0
    while at < len(data):
        tag, at = read_varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 2:
            length, at = read_varint(data, at)
            fields[number] = data[at:at + length].decode()
            at += length
        else:
            fields[number], at = read_varint(data, at)
    return {"user": fields.get(1, ""), "amount": fields.get(2, 0), "seq": fields.get(3, 0)}


def main():
    target, calls = sys.argv[1], json.loads(sys.argv[2])
    options = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 200),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        unary = channel.unary_unary(PAY, request_serializer=None, response_deserializer=None)
        streaming = channel.stream_unary(PAY, request_serializer=None, response_deserializer=None)
        for call in calls:
            metadata = [("idempotency-key", call["key"])] if call.get("key") else []
            message = pay_request(call)
            result = {"user": call["user"]}
            try:
                if call.get("messages", 1) == 1:
                    answer, rpc = unary.with_call(message, metadata=metadata, timeout=20, wait_for_ready=True)
                else:
                    answer, rpc = streaming.with_call(iter([message, message]), metadata=metadata, timeout=20)
                result.update(code="OK", receipt=receipt(answer))
            except grpc.RpcError as error:
                rpc = error
                result.update(code=error.code().name, details=error.details())
            # An error answer is trailers-only: its headers reach the client as trailing metadata.
            metadata = list(rpc.initial_metadata() or ()) + list(rpc.trailing_metadata() or ())
            result["replayed"] = ("idempotent-replayed", "true") in metadata
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
