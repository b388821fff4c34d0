"""A test double for the sentence encoder only: a deterministic, instant bag-of-words embedding.

Tests about the index, retrieval and what uses it run on this; the real MiniLM encoder has its own tests.
"""
import re
import zlib

import numpy as np


class HashingEncoder:
    """Bag of words hashed (crc32, stable across runs) into 256 buckets, L2-normalised."""

    name = "test-hashing-bow-256"
    dim = 256

    def encode(self, texts: list[str]) -> np.ndarray:
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                vectors[row, zlib.crc32(word.encode()) % self.dim] += 1.0
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
