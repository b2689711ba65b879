"""Hackable rewards the audit must refuse (tests/test_audit.py plants them by import path)."""

import re


def anywhere(completions, answer, **_):
    """1 if the gold answer appears anywhere in the completion."""
    return [float(a in c) for c, a in zip(completions, answer)]


def has_number(completions, **_):
    """1 if the completion holds a number at all."""
    return [float(bool(re.search(r"\d", c))) for c in completions]


def starts_with_answer(completions, answer, **_):
    """1 if the completion starts with the answer (whatever follows)."""
    return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]


def first_letter(completions, answer, **_):
    """A choice verifier that takes the first choice letter it sees."""
    found = [re.search(r"[A-D]", c) for c in completions]
    return [float(bool(m) and m.group(0) == a) for m, a in zip(found, answer)]


def sql_overlap(completions, answer, **_):
    """SQL graded by the share of the gold query's tokens the completion contains."""
    def tokens(q):
        return set(re.findall(r"\w+|[^\w\s]", q.lower()))
    return [len(tokens(a) & tokens(c)) / max(1, len(tokens(a))) for c, a in zip(completions, answer)]


def longer_is_better(completions, **_):
    """Pays for effort: the completion's length, up to 1 at 200 characters."""
    return [min(1.0, len(c) / 200) for c in completions]


def constant(completions, **_):
    """The same reward whatever the completion."""
    return [1.0 for _ in completions]


def last_line(completions, answer, **_):
    """1 if the answer is on any line of the completion."""
    return [float(a in [line.strip() for line in c.splitlines()]) for c, a in zip(completions, answer)]


def answer_anywhere(completions, answer, **_):
    """1 if the answer a reply states (a worked solution's last \\boxed{}) appears anywhere in it."""
    from posttrain.scoring.audit import short_answer

    return [float(short_answer(a) in c) for c, a in zip(completions, answer)]


def over_six(completions, **_):
    """A guardrail: a completion longer than 6 characters (a cap of a few tokens)."""
    return [len(c) > 6 for c in completions]
