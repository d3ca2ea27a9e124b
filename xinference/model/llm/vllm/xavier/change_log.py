"""The tracker's change log, kept and sent as packed bytes.

At fleet scale every change of the index fans out to every replica's mirror. Sent as
one pickled ``IndexChange`` per change, each poll of each mirror re-encoded the same
changes object by object, and that encoding became the tracker's largest cost from
eight mirrors on (see benchmark/results/index-scale.md). Here a change is encoded
once, when it is logged, as a record:

    op (1 byte)  rank (int32)  count (uint32)  count keys of KEY_BYTES each

all little-endian (a ``LOCATE`` record carries, per key, the key, then its
device-tier row and generation as int64: where a lease-free reader finds it, see
``store/generations.py``), and a mirror's answer is the concatenation of the records after
its version: one ``bytes`` object, joined once per version range and handed to every
mirror that asks for that range (mirrors woken by the same change ask for the same
one). Replicas send their keys packed the same way (``pack_keys``), so that the
tracker logs what it received without re-encoding it.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from .hashing import BlockHash
from .wire import IndexChange, TrackerChanges

KEY_BYTES = 16  # a BlockHash
_HEADER = struct.Struct("<BiI")
# key, device-tier row, generation (0: not there)
_LOCATION_ENTRY = struct.Struct(f"<{KEY_BYTES}sqq")
LOCATION_BYTES = _LOCATION_ENTRY.size
_OPS = (IndexChange.ADD, IndexChange.REMOVE, IndexChange.FORGET, IndexChange.LOCATE)
_ENTRY_BYTES = (KEY_BYTES, KEY_BYTES, KEY_BYTES, LOCATION_BYTES)
_OP_CODES = {op: code for code, op in enumerate(_OPS)}

# keys of one update: a sequence of BlockHash, or those keys packed (``pack_keys``)
Keys = Sequence[BlockHash] | bytes


def pack_keys(keys: Keys) -> bytes:
    """Keys as one bytes object, KEY_BYTES each."""
    if isinstance(keys, bytes):
        packed = keys
    else:
        packed = b"".join(keys)
        if len(packed) != KEY_BYTES * len(keys):
            raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
    if len(packed) % KEY_BYTES:
        raise ValueError(f"packed keys of {len(packed)} bytes: not {KEY_BYTES} each")
    return packed


def unpack_keys(packed: bytes) -> list[BlockHash]:
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


# (key, device-tier row of its layer 0, generation); generation 0: the key left
# the device tier (a lease-free reader must not use an older location)
Location = tuple[BlockHash, int, int]


def pack_locations(locations: Sequence[Location]) -> bytes:
    """Locations as one bytes object, LOCATION_BYTES each."""
    parts = []
    for key, row, generation in locations:
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
        parts.append(_LOCATION_ENTRY.pack(key, row, generation))
    return b"".join(parts)


def unpack_locations(packed: bytes) -> list[Location]:
    if len(packed) % LOCATION_BYTES:
        raise ValueError(f"packed locations of {len(packed)} bytes: not whole")
    # one C-level pass: the tracker unpacks every LOCATE record it logs
    return list(_LOCATION_ENTRY.iter_unpack(packed))


def encode(op: str, rank: int, packed_keys: bytes = b"") -> bytes:
    """One change as a record (``packed_keys`` as ``pack_keys`` made them; for
    ``LOCATE``, as ``pack_locations`` made them)."""
    code = _OP_CODES[op]
    count = len(packed_keys) // _ENTRY_BYTES[code]
    return _HEADER.pack(code, rank, count) + packed_keys


def decode(records: bytes) -> Iterator[tuple[str, int, bytes]]:
    """(op, rank, packed keys) of each record, in order."""
    offset, end = 0, len(records)
    while offset < end:
        code, rank, count = _HEADER.unpack_from(records, offset)
        offset += _HEADER.size
        if code >= len(_OPS):
            raise ValueError(f"corrupt change record at byte {offset - _HEADER.size}")
        stop = offset + count * _ENTRY_BYTES[code]
        if stop > end:
            raise ValueError(f"corrupt change record at byte {offset - _HEADER.size}")
        yield _OPS[code], rank, records[offset:stop]
        offset = stop


def split_records(records: bytes) -> list[bytes]:
    """The records one by one, as encoded (a relay logs them version by version)."""
    out, offset = [], 0
    for _, _, keys in decode(records):
        stop = offset + _HEADER.size + len(keys)
        out.append(records[offset:stop])
        offset = stop
    return out


def decode_changes(records: bytes) -> tuple[IndexChange, ...]:
    """The records as ``IndexChange`` objects (tests, tools; mirrors use ``decode``)."""
    return tuple(
        IndexChange(
            op,
            rank,
            (
                tuple(entry[0] for entry in unpack_locations(keys))
                if op == IndexChange.LOCATE
                else tuple(unpack_keys(keys))
            ),
        )
        for op, rank, keys in decode(records)
    )


def all_changes(changes: TrackerChanges) -> tuple[IndexChange, ...]:
    """Every change of an answer, in the order a mirror applies them."""
    return changes.changes + decode_changes(changes.packed)


def encode_snapshot(
    blocks_by_rank: Iterable[tuple[int, Iterable[BlockHash]]],
    located_by_rank: Iterable[tuple[int, Sequence[Location]]] = (),
) -> bytes:
    """A whole index as ADD records, one per rank, then LOCATE records of the
    keys with a location (a mirror starting from it can read lease-free at once)."""
    added = [
        encode(IndexChange.ADD, rank, b"".join(keys)) for rank, keys in blocks_by_rank
    ]
    located = [
        encode(IndexChange.LOCATE, rank, pack_locations(locations))
        for rank, locations in located_by_rank
    ]
    return b"".join(added + located)


class ChangeLog:
    """The last changes, at least ``max_keys`` keys' worth, as encoded records."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._records: deque[tuple[int, bytes]] = deque()  # (version, record)
        self._keys = 0
        # since -> the records after it, up to ``_joined_upto``: mirrors woken by one
        # change ask for the same range, and are answered with the same bytes
        self._joined: dict[int, bytes] = {}
        self._joined_upto = 0

    def append(self, version: int, record: bytes) -> None:
        self._records.append((version, record))
        self._keys += _keys_in(record)
        while self._keys > self.max_keys and len(self._records) > 1:
            self._keys -= _keys_in(self._records.popleft()[1])

    def reaches(self, since: int) -> bool:
        """Whether the log holds every change after version ``since``."""
        return not self._records or since >= self._records[0][0] - 1

    def since(self, since: int, version: int) -> bytes:
        """The records after ``since`` up to the newest, ``version`` (check
        ``reaches`` first). Walks back from the newest only as far as needed: this
        runs on every poll of every mirror, in the supervisor's process."""
        if version != self._joined_upto:
            self._joined.clear()
            self._joined_upto = version
        joined = self._joined.get(since)
        if joined is None:
            newer = []
            for logged, record in reversed(self._records):
                if logged <= since:
                    break
                newer.append(record)
            newer.reverse()
            joined = self._joined[since] = b"".join(newer)
        return joined


def _keys_in(record: bytes) -> int:
    return int(_HEADER.unpack_from(record)[2])
