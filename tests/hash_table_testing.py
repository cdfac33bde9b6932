"""A Python dict model of jaxrec.ops.hash_table, written independently of it (the bucket
function in Python ints, one bucket and one id at a time): tests/test_hash_table.py and
tests/nn/test_dynamic_vocab.py check the table and the dynamic collections against it."""

from __future__ import annotations

import collections
import zlib

import numpy as np

M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def fmix(i: int, bits: int) -> int:
    if bits == 32:
        h = i & M32
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & M32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & M32
        return h ^ (h >> 16)
    h = i & M64
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    return h ^ (h >> 33)


def unfmix(h: int, bits: int) -> int:
    """The id whose fmix is ``h`` (fmix is a bijection), as a signed int: ids of chosen hashes."""
    if bits == 32:
        h ^= h >> 16
        h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & M32
        h ^= (h >> 13) ^ (h >> 26)
        h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & M32
        h ^= h >> 16
    else:
        h ^= h >> 33
        h = (h * pow(0xC4CEB9FE1A85EC53, -1, 1 << 64)) & M64
        h ^= h >> 33
        h = (h * pow(0xFF51AFD7ED558CCD, -1, 1 << 64)) & M64
        h ^= h >> 33
    return h - (1 << bits) if h >> (bits - 1) else h


def fresh_row(name: str, step: int, i: int, bits: int, dim: int, low: float, high: float) -> np.ndarray:
    """A dynamic table's new row for id ``i`` (jaxrec.nn.dynamic.fresh_rows, default init):
    uniform in [low, high) from fmix32 of (crc32 of the name, step, the id's words, column)."""
    h = fmix(zlib.crc32(name.encode()) ^ fmix(step, 32), 32)
    words = [i & M32] if bits == 32 else [i & M32, (i >> 32) & M32]
    for w, word in enumerate(words):
        h = fmix(h ^ fmix((word + 0x9E3779B9 * (w + 1)) & M32, 32), 32)
    unit = np.array([fmix(h ^ ((c * 0x85EBCA77) & M32), 32) >> 8 for c in range(dim)], np.float32) * np.float32(2**-24)
    return np.float32(low) + np.float32(high - low) * unit


class DictModel:
    """The table as a dict id -> slot plus per-slot arrays, updated one id at a time: a
    bucket's new ids in hash order take its empty slots by position, then the slots no id
    of the batch uses (nor, with keep_seen, an earlier call of the step saw) by (score,
    position)."""

    def __init__(self, num_buckets, size, policy, bits):
        self.nb, self.size, self.policy, self.bits = num_buckets, size, policy, bits
        self.slot_of = {}
        self.keys = np.zeros(num_buckets * size, np.int64)
        self.used = np.zeros(num_buckets * size, bool)
        self.digests = np.zeros(num_buckets * size, np.uint8)
        self.scores = np.zeros(num_buckets * size, np.int64)
        self.seen = np.full(num_buckets * size, -1, np.int64)

    def bucket(self, i):
        h = fmix(i, self.bits)
        return ((h >> 32 if self.bits == 64 else h) * self.nb) >> 32

    def digest(self, i):
        return fmix(i, self.bits) & 0xFF or 1

    def find_or_insert(self, ids, valid, step, keep_seen=False):
        counts = collections.Counter(int(i) for i, v in zip(ids, valid) if v)
        found = {i: self.slot_of[i] for i in counts if i in self.slot_of}
        hit = set(found.values())
        slot_for, fresh = dict(found), set()
        inserted = evicted = failed = 0
        missing = sorted((i for i in counts if i not in found), key=lambda i: (self.bucket(i), fmix(i, self.bits)))
        for b in sorted({self.bucket(i) for i in missing}):
            cells = range(b * self.size, (b + 1) * self.size)
            empty = [c for c in cells if not self.used[c]]
            old = [] if self.policy == "none" else sorted(
                (c for c in cells if self.used[c] and c not in hit and not (keep_seen and self.seen[c] == step)),
                key=lambda c: (self.scores[c], c))
            candidates = empty + old
            for rank, i in enumerate(i for i in missing if self.bucket(i) == b):
                if rank >= len(candidates):
                    failed += 1
                    slot_for[i] = -1
                    continue
                c = candidates[rank]
                if self.used[c]:
                    evicted += 1
                    del self.slot_of[int(self.keys[c])]
                self.keys[c], self.used[c], self.digests[c], self.slot_of[i] = i, True, self.digest(i), c
                slot_for[i] = c
                fresh.add(c)
                inserted += 1
        for i, c in slot_for.items():
            if c >= 0:
                self.seen[c] = step
                self.scores[c] = (self.scores[c] if i in found else 0) + counts[i] if self.policy == "lfu" else step
        slots = [slot_for[int(i)] if v else -1 for i, v in zip(ids, valid)]
        return np.asarray(slots), fresh, (inserted, evicted, failed)
