import pytest

from agentrl.data import RLDataLoader

ROWS = [{"id": i} for i in range(10)]


def ids(batch):
    return [row["id"] for row in batch]


def test_len_and_drop_last():
    assert len(RLDataLoader(ROWS, 3)) == 3
    assert len(RLDataLoader(ROWS, 3, drop_last=False)) == 4
    assert len(RLDataLoader(ROWS, 5)) == 2


def test_unshuffled_epoch_is_in_order_and_drops_the_tail():
    loader = RLDataLoader(ROWS, 3, shuffle=False)
    assert [ids(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert loader.state_dict() == {"epoch": 1, "position": 0, "seed": 1, "num_rows": 10}
    partial = RLDataLoader(ROWS, 4, shuffle=False, drop_last=False)
    assert [ids(b) for b in partial] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_shuffle_is_a_permutation_per_epoch_fixed_by_seed():
    loader = RLDataLoader(ROWS, 5, seed=3)
    epoch0 = [i for b in loader for i in ids(b)]
    epoch1 = [i for b in loader for i in ids(b)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # a new order each epoch
    again = RLDataLoader(ROWS, 5, seed=3)
    assert [i for b in again for i in ids(b)] == epoch0
    other = RLDataLoader(ROWS, 5, seed=4)
    assert [i for b in other for i in ids(b)] != epoch0


def test_next_rolls_over_epochs():
    loader = RLDataLoader(ROWS, 4, shuffle=False)
    assert [ids(next(loader)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert (loader.epoch, loader.position) == (1, 1)


def test_resume_continues_identically():
    reference = RLDataLoader(ROWS, 3, seed=7)
    expected = [ids(next(reference)) for _ in range(8)]  # crosses two epoch boundaries

    first = RLDataLoader(ROWS, 3, seed=7)
    seen = [ids(next(first)) for _ in range(4)]
    state = first.state_dict()
    assert state == {"epoch": 1, "position": 1, "seed": 7, "num_rows": 10}

    resumed = RLDataLoader(ROWS, 3, seed=99)  # the saved seed wins
    resumed.load_state_dict(state)
    seen += [ids(next(resumed)) for _ in range(4)]
    assert seen == expected


def test_resume_inside_a_for_loop_epoch():
    full = RLDataLoader(ROWS, 2, seed=5)
    epoch0 = [ids(b) for b in full]
    interrupted = RLDataLoader(ROWS, 2, seed=5)
    for step, _ in enumerate(interrupted):
        if step == 1:
            break
    resumed = RLDataLoader(ROWS, 2, seed=5)
    resumed.load_state_dict(interrupted.state_dict())
    assert [ids(b) for b in resumed] == epoch0[2:]
    assert resumed.epoch == 1


def test_batches_are_copies():
    loader = RLDataLoader(ROWS, 2, shuffle=False)
    next(loader)[0]["id"] = -1
    assert ROWS[0]["id"] == 0


def test_errors():
    with pytest.raises(ValueError, match=r"batch_size=11 is larger than the dataset \(10 rows\)"):
        RLDataLoader(ROWS, 11)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        RLDataLoader(ROWS, 0)
    loader = RLDataLoader(ROWS, 2)
    with pytest.raises(ValueError, match="saved for 12 rows but the dataset has 10"):
        loader.load_state_dict({"epoch": 0, "position": 0, "seed": 1, "num_rows": 12})
