"""The RLJob's key Secret ``NAME-api-key`` from the controller's side: created once with a random
key, and never mistaken for a Secret of that name that someone else made, although the operator
cannot read Secrets (it may only create them: a grant to read would read every Secret of the
namespace).

Its own is known by the record on ``NAME-config`` (operator/rljob_operator/record.py), entry ``key``:

- ``none``: the operator has not created it. A pass records ``pending`` *before* it sends the
  create, so a create answered 201 whose outcome a crash lost is still known as its own. An
  "already exists" in that pass is someone else's Secret: the record goes back to ``none`` and the
  pass is refused (:class:`ForeignKey`) before anything that would read the key is made.
- ``pending``: a pass sent the create (or was about to) and its outcome was not recorded: an
  "already exists" now is the operator's own. Not told apart: a Secret someone else made in the
  moment between that record and the create, or a refusal whose ``none`` a crash lost.
- ``created``: the operator's own (also what a record written before the entry existed says).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rljob_operator.applied import owner_uid
from rljob_operator.kube import MAX_REMEMBERED_OWNERS, Kube, NotOurs
from rljob_operator.observe import controlled_by
from rljob_operator.reconcile import Decision
from rljob_operator.record import KeyState, read_memory, record_of, with_key


class ForeignKey(NotOurs):
    """The key Secret's name is taken by a Secret the operator did not create for this RLJob."""

    def __init__(self, name: str) -> None:
        self.kind, self.name = "Secret", name
        Exception.__init__(
            self,
            f"Secret {name} already exists and the operator did not create it for this RLJob, so it is not used as "
            "the rollout servers' API key: nothing that would read it is created or changed. Fix: delete or rename "
            f"that Secret (the operator then creates {name} with a random key), or set spec.apiKeySecret.name: "
            f"{name} to use it as the key on purpose",
        )


class KeySecrets:
    """Creates each RLJob's key Secret, once per process, and remembers those found its own: a
    steady state sends no request for them."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._ours: set[tuple[str, str, str | None]] = set()  # (namespace, name, RLJob uid)

    def ensure(self, secret: dict[str, Any], decision: Decision, write: Callable[[dict[str, Any]], object]) -> None:
        """Create ``secret`` unless it is already this RLJob's; :class:`ForeignKey` if someone else's.
        ``write`` applies the record's ConfigMap; the one in ``decision.apply`` ends up saying ``created``."""
        meta = secret["metadata"]
        mark = (meta["namespace"], meta["name"], owner_uid(secret))
        if mark not in self._ours:
            state = decision.key if decision.key != "none" else self._recorded(secret, decision)
            if state == "none":
                self._record(decision, "pending", write)
            if not self.kube.create_key(secret) and state == "none":
                self._record(decision, "none", write)
                raise ForeignKey(meta["name"])
            if len(self._ours) >= MAX_REMEMBERED_OWNERS:
                self._ours.clear()
            self._ours.add(mark)
        decision.apply = with_key(decision.apply, "created")

    def _recorded(self, secret: dict[str, Any], decision: Decision) -> KeyState:
        """The record as the API server has it: a pass that did not list the children (its RLJob's
        status was empty) decided without it."""
        config = record_of(decision.apply)
        if config is None:
            return "none"
        live = self.kube.get("ConfigMap", config["metadata"]["namespace"], config["metadata"]["name"])
        return read_memory(live).key if live is not None and controlled_by(live, owner_uid(secret)) else "none"

    @staticmethod
    def _record(decision: Decision, state: KeyState, write: Callable[[dict[str, Any]], object]) -> None:
        config = record_of(with_key(decision.apply, state))
        if config is not None:
            write(config)
