"""A session's prompt crosses the pipe as a delta (engine/ipc/prompt_delta.py): the engine rebuilds exactly
the ids the API process had, and anything it cannot rebuild (restart, an unknown version, a wrong check) is
refused, never guessed; over HTTP a session's later turns answer as the same prompt sent whole."""

from __future__ import annotations

import pickle
import random
from array import array

import httpx

from agentbox.engine.ipc.prompt_delta import MIN_SHARED, PromptSender, PromptStore


def _through_pipe(sender: PromptSender, store: PromptStore, key: str | None, ids: list[int]) -> list[int] | None:
    sent, version, base, shared, check = pickle.loads(pickle.dumps(sender.encode(key, ids)))
    got = store.rebuild(key, version, sent, base, shared, check)
    return None if got is None else got.ids


def test_rebuilt_prompts_equal_the_sent_ones() -> None:
    rng = random.Random(0)
    sender, store = PromptSender(max_keys=2), PromptStore(max_keys=2)
    prompts = {k: [rng.randrange(50_000) for _ in range(MIN_SHARED + 100)] for k in ("a", "b", "c")}
    for turn in range(30):
        key = rng.choice("abc")
        cut = rng.choice([len(prompts[key]), len(prompts[key]) - 5, MIN_SHARED // 2])  # grows, edits, or restarts
        prompts[key] = prompts[key][:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 40))]
        # the server sends the incremental tokenizer's int32 arrays; other callers lists
        sent = pickle.loads(pickle.dumps(sender.encode(key, array("i", prompts[key]) if turn % 2 else prompts[key])))
        got = store.rebuild(key, sent[1], sent[0], *sent[2:])
        assert got is not None and isinstance(got.ids, list) and got.ids == prompts[key], turn  # requests take lists
        # the array the cache compares: the same ids, whenever the history came as arrays
        assert got.array is None or (got.array.typecode == "i" and got.array.tolist() == prompts[key]), turn
        if sent[3] == 0:
            assert (got.array is not None) == isinstance(sent[0], array), turn
        if sent[3]:
            assert len(sent[0]) < 50  # only the new ids crossed
    assert _through_pipe(sender, store, None, [1, 2, 3]) == [1, 2, 3]


def test_idle_spare_copies_rebuild_the_same_prompts_and_leave_the_last_requests_lists_alone() -> None:
    """As the engine runs: each rebuilt list is a request's, which appends its output; while no request runs the
    store copies the last prompts (prepare_spare), and a later delta cuts and extends those copies in place."""
    rng = random.Random(1)
    sender, store = PromptSender(max_keys=3), PromptStore(max_keys=3)
    prompts = {k: [rng.randrange(50_000) for _ in range(MIN_SHARED + 50)] for k in "abc"}
    held: list[tuple[list[int], list[int], array | None, list[int]]] = []  # (list, its ids then, array, array's)
    spared = reused = 0
    for turn in range(60):
        key = rng.choice("abc")
        cut = rng.choice([len(prompts[key]), len(prompts[key]) - 3, MIN_SHARED + 1, MIN_SHARED // 2])
        prompts[key] = prompts[key][:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 30))]
        sent = pickle.loads(pickle.dumps(sender.encode(key, array("i", prompts[key]) if turn % 3 else prompts[key])))
        entry = store._last.get(key)
        spare = None if entry is None or entry.version != sent[2] else entry.spare_ids
        got = store.rebuild(key, sent[1], sent[0], *sent[2:])
        assert got is not None and got.ids == prompts[key], turn
        assert got.array is None or got.array.tolist() == prompts[key], turn
        reused += sent[3] > 0 and spare is not None
        assert got.ids is spare or not sent[3] or spare is None, turn  # a delta on a spare takes it, no copy
        got.ids.extend(rng.randrange(50_000) for _ in range(rng.randrange(0, 20)))  # the request's output
        held.append((got.ids, list(got.ids), got.array, [] if got.array is None else got.array.tolist()))
        if rng.random() < 0.6:  # an idle moment: no request runs
            while store.prepare_spare():
                spared += 1
        for ids, then, arr, arr_then in held:  # no rebuild touched a list or array a request was given
            assert ids == then and (arr is None or arr.tolist() == arr_then), turn
    assert spared > 10 and reused > 5
    while store.prepare_spare():
        pass
    assert not store.prepare_spare()  # every kept prompt has its copies


def test_an_unknown_base_is_refused() -> None:
    sender, store = PromptSender(), PromptStore()
    ids = list(range(1000))
    assert _through_pipe(sender, store, "s", ids) == ids
    assert _through_pipe(sender, PromptStore(), "s", [*ids, 7]) is None  # a restarted engine knows no base
    sender.forget("s")  # what the client does on that answer: the full ids go
    assert _through_pipe(sender, store, "s", [*ids, 7]) == [*ids, 7]
    sent, version, base, shared, check = sender.encode("s", [*ids, 7, 8])
    assert shared and store.rebuild("s", version, sent, base, shared, check + 1) is None  # a wrong check
    assert store.rebuild("s", version, sent, base + 1, shared, check) is None  # another version


def test_session_turns_answer_as_the_whole_prompt(live_server: str) -> None:
    """Turn 2 of a session goes as a delta; its greedy answer and prompt size equal the same
    conversation sent without a session (whole ids, nothing kept)."""
    msgs = [{"role": "system", "content": "You are terse. " + "Keep answers short. " * 70},
            {"role": "user", "content": "Name a color."}]
    with httpx.Client(base_url=live_server, timeout=120) as c:
        for turn in range(2):
            body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": msgs, "max_tokens": 6, "temperature": 0}
            a = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "delta-1"}).json()
            b = c.post("/v1/chat/completions", json=body).json()
            assert a["choices"][0]["message"] == b["choices"][0]["message"], turn
            assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"], turn
            if turn:
                assert a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            msgs = [*msgs, a["choices"][0]["message"], {"role": "user", "content": f"And another ({turn})?"}]


def test_a_sessions_next_request_writes_only_its_new_page_columns() -> None:
    """engine/cache/rows.py and engine/exec/page_table.py: the row a session's last request held keeps its pages;
    the next request of that session takes it and writes only the columns after the first difference, and the
    table row it reads is its own pages whatever another session did in between."""
    import torch

    from agentbox.engine.cache.rows import RowPool
    from agentbox.engine.cache.seq_cache import SeqCache
    from agentbox.engine.exec.page_table import PageTable, RowWriter

    pool, writer, table = RowPool(2), RowWriter(2), PageTable(2, 64, torch.device("cpu"))

    def run(sid: str, pages: list[int]) -> int:
        h = SeqCache(list(pages), pool.take(sid))
        updates = writer.updates([h])
        table.apply(torch.tensor(updates, dtype=torch.int64).reshape(-1, 3))
        assert table.table[h.row, : len(pages)].tolist() == pages
        pool.give_back(h.row)  # the request is done
        return len(updates) // 3

    history = list(range(10, 50))
    assert run("a", history) == 40
    assert run("b", [7, 8, 9]) == 3  # another session, another row
    assert run("a", [*history[:-1], 90, 91]) == 2  # the last page was partial: rewritten, one more
    assert run("b", [7, 8, 9, 5]) == 1
    assert run("c", [3, *history]) == 41  # a new session takes a free row: rewritten from the first difference


def test_a_sessions_row_comes_back_while_other_rows_are_free() -> None:
    """A session's next request takes its own row back (its last request is done) and writes only its new column,
    not the whole history into a fresh row; a running request's row is never taken; a cut tail is rewritten."""
    import torch

    from agentbox.engine.cache.rows import RowPool
    from agentbox.engine.cache.seq_cache import SeqCache
    from agentbox.engine.exec.page_table import PageTable, RowWriter

    pool, writer, table = RowPool(8), RowWriter(8), PageTable(8, 64, torch.device("cpu"))
    history, held = list(range(10, 50)), []
    for turn, pages in enumerate((history, [*history, 60], [*history, 60, 61])):
        h = SeqCache(list(pages), pool.take("a"))
        updates = writer.updates([h])
        table.apply(torch.tensor(updates, dtype=torch.int64).reshape(-1, 3))
        assert table.table[h.row, : len(pages)].tolist() == pages
        assert len(updates) // 3 == (40 if turn == 0 else 1)
        held.append(h.row)
        if turn < 2:
            pool.give_back(h.row)
    assert len(set(held)) == 1
    other = SeqCache([7], pool.take("a"))  # the session's row is still running: another one
    assert other.row != held[0]
    h.cut(40)  # a rejected draft's tail: the row is rewritten from the cut
    h.pages.append(77)
    updates = writer.updates([h])
    table.apply(torch.tensor(updates, dtype=torch.int64).reshape(-1, 3))
    assert updates == [h.row, 40, 77] and table.table[h.row, :41].tolist() == [*history, 77]
