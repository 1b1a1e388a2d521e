"""The generated blocks of README.md: the text between a begin and an end marker line belongs to
one generator (tools/capability_matrix.py, tools/performance_page.py), which rewrites it."""


def replace_block(text: str, begin: str, end: str, block: str):
    """`text` with what lies between `begin` and `end` replaced by `block` (which should end in
    a newline); None when either marker is missing."""
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}{end}{tail}"
