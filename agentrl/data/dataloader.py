"""Batches of dataset rows, epoch after epoch, with a state that a resumed run continues from.

The order of an epoch depends only on (seed, epoch), never on what ran before, so restoring
`{epoch, position, seed}` from a checkpoint yields exactly the batches the interrupted run would
have seen next.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any


class RLDataLoader:
    """`for batch in loader` runs the rest of the current epoch; `next(loader)` rolls over epochs.

    A batch is a list of row dicts (shallow copies, so callers may add keys). `len(loader)` is the
    number of batches per epoch.
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(rows):
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({len(rows)} rows) with drop_last=True, "
                "so an epoch would have no batch; lower the batch size or add rows"
            )
        if not rows:
            raise ValueError("the dataset has no rows")
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        full, rest = divmod(len(self.rows), self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _batch(self, epoch: int, position: int) -> list[dict[str, Any]]:
        order = self._order(epoch)
        chunk = order[position * self.batch_size : (position + 1) * self.batch_size]
        return [dict(self.rows[i]) for i in chunk]

    def __next__(self) -> list[dict[str, Any]]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        batch = self._batch(self.epoch, self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """The remaining batches of the current epoch; afterwards the loader stands at the next epoch."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        epoch = self.epoch
        while self.epoch == epoch and self.position < len(self):
            yield next(self)
        if self.epoch == epoch:
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a checkpointed position; refuses a state saved for a dataset of another size."""
        if state.get("num_rows", len(self.rows)) != len(self.rows):
            raise ValueError(
                f"dataloader state was saved for {state['num_rows']} rows but the dataset has {len(self.rows)}; "
                "resume with the same data files"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])
