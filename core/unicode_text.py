"""Whether a Python ``str`` is Unicode text a tokenizer can take.

A ``str`` may hold a lone UTF-16 surrogate (U+D800 to U+DFFF): JSON's ``"\\ud800"``
escape decodes to one, and so does ``surrogateescape`` decoding. No Unicode text
holds one, UTF-8 cannot encode it, and the tokenizers refuse the whole string with a
``TypeError`` that names neither the string nor the character. Every place that
tokenizes text a caller gave (prompts, bad words, the server's routes) asks here
first and refuses it by name.
"""

from __future__ import annotations


def lone_surrogate(text: str) -> str | None:
    """For text holding a lone surrogate, the refusal's words after the field's name
    (``"holds a lone UTF-16 surrogate (U+D800 at character 3), ..."``, the first one);
    None for Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X} at character "
                f"{e.start}), which is not a Unicode character and cannot be tokenised")
    return None
