"""The shard tests' shared inputs: one corpus and one tokenizer trained on it, built once a module
(module scope: each test file builds its own)."""

from __future__ import annotations

import pytest

from tests.fixtures.shard import make_docs, write_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return make_docs()


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, corpus)
    return d / "tokenizer"
