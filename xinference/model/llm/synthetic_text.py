"""Deterministic text the test models' tokenizers are trained on.

The release-shaped tiny model and the Llama-shaped model both learn a byte-level BPE
offline; they share this corpus so both vocabularies come from the same text.
"""

from __future__ import annotations


def synthetic_corpus() -> list[str]:
    """Deterministic pseudo-English: syllable words in sentences, numbers, punctuation.

    Varied enough for the trainer to learn about a thousand merges.
    """
    syllables = [
        "ka",
        "lo",
        "mi",
        "ne",
        "su",
        "ta",
        "ri",
        "po",
        "de",
        "va",
        "the",
        "and",
        "ing",
        "er",
        "on",
        "st",
        "ch",
        "qu",
        "ex",
        "pre",
        "tion",
        "al",
        "or",
        "en",
    ]
    words = [a + b for a in syllables for b in syllables]
    words += [
        a + b + c for a in syllables[:8] for b in syllables for c in syllables[:6]
    ]
    lines = []
    state = 12345
    for n in range(4000):
        sentence = []
        for _ in range(8):
            state = (state * 1103515245 + 12345) % (1 << 31)  # fixed LCG
            sentence.append(words[state % len(words)])
        lines.append(" ".join(sentence) + f", {n % 1000}. ")
    return lines
