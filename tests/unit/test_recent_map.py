"""RecentMap: the bounded least-recently-used map behind the chat-prompt and picture caches."""

from __future__ import annotations

from agentrl.recent_map import RecentMap


def test_recent_map_forgets_the_least_recently_used_entries_beyond_its_budget():
    """Least recently used first; `hits` counts the values found rather than made."""
    made: list[str] = []
    recent = RecentMap(2)

    def get(key: str) -> str:
        return recent.get_or_make(key, lambda: made.append(key) or key.upper())

    assert [get("a"), get("b"), get("a")] == ["A", "B", "A"]  # "a" made once, then found
    get("c")  # over the budget: "b", the least recently used, goes
    assert list(recent.entries) == ["a", "c"]
    get("b")
    assert made == ["a", "b", "c", "b"] and recent.hits == 1
    # Weighed by size: a budget of 10 characters keeps the newest strings that fit, and always the last one.
    sized = RecentMap(10, len)
    for text in ("aaaa", "bbbb", "cccc"):
        sized.get_or_make(text, lambda text=text: text)
    assert list(sized.entries) == ["bbbb", "cccc"] and sized.used == 8
    sized.get_or_make("x" * 30, lambda: "x" * 30)
    assert list(sized.entries) == ["x" * 30] and sized.used == 30
