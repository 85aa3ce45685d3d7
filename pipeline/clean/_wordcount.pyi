"""Types of pipeline/clean/_wordcount.c (the compiled word counter; see its header)."""

from collections.abc import Callable, Iterable, Sequence

PATTERN_SHA256: str

def ascii_words(text: str) -> list[str]: ...

class Counter:
    cache_size: int
    def __init__(
        self,
        findall_ascii: Callable[[str], Sequence[str]],
        findall: Callable[[str], Sequence[str]],
        piece_words: Callable[[str], Sequence[str]],
        url_fullmatch: Callable[[str], object],
        special_pieces: frozenset[str],
        split_words: frozenset[str],
        split_alnum: Iterable[str],
        stop_bits: dict[str, int],
        punctuation: Iterable[str],
        cache_size: int,
    ) -> None: ...
    def counts(self, text: str) -> tuple[int, int, int, int, int]: ...
    def forget(self) -> None: ...
    def __len__(self) -> int: ...
