"""Reading a request body within bounds: in time (--body-timeout), in size after decompression
(--max-request-bytes), and in JSON structure (a cap on arrays and objects), so one request cannot stall the
event loop that every other request and the health probes share.

aiohttp's own decompression is off (the runner's auto_decompress=False): it would inflate a 1 MB gzip bomb
to 1 GiB before the size limit looked at it. Here the inflation stops at the limit.
"""

from __future__ import annotations

import asyncio
import json
import zlib

from aiohttp import web

from kiln.serve.client_json import long_integer_error
from kiln.serve.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

# A JSON parse holds the GIL (a thread would not keep the loop free), so its cost is bounded instead: an
# 8 MiB body of two hundred thousand arrays/objects parses in well under 0.1 s. Counted as bytes, so
# brackets inside strings count too: a conservative bound that legitimate requests stay far below.
MAX_JSON_CONTAINERS = 200_000
_INFLATE_IN_THREAD_BYTES = 64 * 1024  # zlib releases the GIL: inflate big bodies off the loop
_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}


async def read_body(request: web.Request, *, timeout_s: float, max_bytes: int) -> bytes:
    """The request body, decoded per its Content-Encoding (identity, gzip, deflate), at most `max_bytes`
    after decoding. Raises RequestTimeout, PayloadTooLarge, UnsupportedMediaType or InvalidRequest."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s (--body-timeout)") from None
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in _WBITS:
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send the body as identity, "
                                   f"gzip or deflate", "Content-Encoding")
    if len(raw) > _INFLATE_IN_THREAD_BYTES:
        return await asyncio.to_thread(inflate, raw, encoding, max_bytes)
    return inflate(raw, encoding, max_bytes)


def inflate(raw: bytes, encoding: str, max_bytes: int) -> bytes:
    """`raw` decompressed, stopping (PayloadTooLarge) as soon as it exceeds `max_bytes`."""
    attempts = [_WBITS[encoding]] + ([-15] if encoding == "deflate" else [])  # zlib-wrapped, else raw deflate
    for wbits in attempts:
        inflater = zlib.decompressobj(wbits)
        try:
            body = inflater.decompress(raw, max_bytes + 1)
        except zlib.error as e:
            if wbits != attempts[-1]:
                continue
            raise InvalidRequest(f"the body is not valid {encoding} data (Content-Encoding: {encoding}): {e}",
                                 "Content-Encoding") from None
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"the request body inflates to more than the server's limit of {max_bytes} bytes "
                                  f"(--max-request-bytes)")
        if not inflater.eof:
            raise InvalidRequest(f"the body is truncated {encoding} data (Content-Encoding: {encoding})",
                                 "Content-Encoding")
        return body
    raise AssertionError("unreachable")


def check_json_containers(raw: bytes) -> None:
    """PayloadTooLarge when `raw` could hold more JSON arrays and objects than a request may."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise PayloadTooLarge(f"the request body holds {containers} JSON arrays and objects; this server parses at "
                              f"most {MAX_JSON_CONTAINERS} per request")


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or InvalidRequest / PayloadTooLarge saying what is wrong with it."""
    check_json_containers(raw)
    try:
        body = json.loads(raw)
    # RecursionError: nested too deep; ValueError: also an integer of more digits than Python converts
    except (ValueError, RecursionError) as e:
        long_integer = long_integer_error(raw)  # name the field when that was the reason
        if long_integer is not None:
            raise long_integer from None
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body
