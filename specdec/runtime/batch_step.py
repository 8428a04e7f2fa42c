"""One step of the batch engine: every running request planned, drafted, scored in one target call, committed.

A step, top to bottom (`BatchStep._step`):
1. plan: each request's loop asks its policy for a situation and K (specdec/runtime/loop.py `plan`),
   unless no draft could pay for its call this step (`_drafts_cannot_pay`);
2. look up: prompt lookup costs nothing to ask, so its drafts are found first and the plan weighs
   those that exist (it often finds fewer than K, or none);
3. choose K: the batch plan (batch_plan.py) lowers a K the request did not set where the batch
   serves more tokens per second without it; lookup drafts it leaves unverified become shadows;
4. draft: the draft models' and heads' calls of all rows, shared round by round (batch_drafting.py); under a
   grammar, drafts it refuses are cut and each verify row gets its mask (loop.py `constrain`);
5. ONE target call (batch_calls.py): the ragged-rows call over every row, else the batched decode
   call for the rows without drafts and a batch-1 verify call for each other;
6. commit each row (loop.py `commit`, the only place that rolls back) and deliver its iteration.
Each request's part of the step lives on it (`BatchRequest.row`), not in lists kept in step by index.
"""

from __future__ import annotations

import time
from dataclasses import replace

from specdec.runtime.batch_calls import RowLogits
from specdec.runtime.batch_plan import choose_draft_lengths_ragged, choose_speculating, drafts_cannot_pay
from specdec.runtime.batch_request import (BatchRequest, RowPlan, draft_candidate, draft_lag, drafts_free, k_gives_way,
                                           largest_k)
from specdec.runtime.guess_rows import GUESS, guess, guesses_within
from specdec.runtime.loop import MAX_DRAFT_ROOM, commit, constrain, draft, draft_room, plan

# Drafts must promise this much more than a step without them: every other row pays for a wrong yes, and a
# request's acceptance is known from a few iterations (at 1.0, n-gram rows drafted under load and lost 16%).
DRAFT_MARGIN = 1.25


class BatchStep:
    """BatchEngine's step (a part of BatchEngine, split off by job).

    Reads the engine's running requests (`_running`), its target calls (`calls`), its draft rounds
    (`drafting`), its slots (`arena`) and its guards (`_guarded`, `_guarded_all`, `_deliver`,
    `_chunk_fed`, `_reap_cancelled`).
    """

    def _step(self, admitted: list[BatchRequest] = ()) -> None:
        """Advance every running request by one target call; the `admitted` requests' prompt chunks (`chunk`) ride
        the same call, a ragged-rows one, and those whose prompt they end join the running ones."""
        start = time.perf_counter()  # a step's cost is all of it (planning, drafting, commits), not the call alone
        running = list(self._running)
        admitted = list(admitted)
        self._plan_rows(running, asked=bool(admitted) or not self._drafts_cannot_pay(running))
        for request, k in zip(running, self._draft_lengths(running, sum(len(r.chunk) for r in admitted))):
            request.choose_k(k)
        self.drafting.draft_all(running)
        self._guess_lone_rows(running, sum(len(r.chunk) for r in admitted), bool(admitted))
        self._constrain_rows(running)
        self._score_and_commit(running, admitted, start)
        self._reap_cancelled()

    def _guess_lone_rows(self, running: list[BatchRequest], prompt_tokens: int, admitted: bool) -> None:
        """Give a 1-token guess to the requests whose row would be a lone query row while their reply is still
        reusable, as many as the step's measured costs allow (guess_rows.py); the guess is verified as any draft."""
        arena, calls = self.arena, self.calls
        if not (self.reply_reuse_share and arena.limits_reuse and arena.keep_prefixes):
            return
        lone = [r for r in running if not r.row.proposal.tokens and _guessable(r)]
        if not lone:
            return
        ragged = admitted or calls.ragged_mode(running)
        if ragged:
            tokens = prompt_tokens + sum(1 + len(r.row.proposal.tokens) for r in running)
            batched = not admitted and not calls.plain_steps_ragged() and not any(
                r.hidden or r.row.proposal.tokens for r in running)  # else a ragged call anyway

            def step_seconds(guesses: int) -> float:  # a step with no drafts is a batched decode call
                if guesses == 0 and batched:
                    return calls.batch_costs.seconds(len(running))
                return calls.ragged_costs.seconds(tokens + guesses)
        elif len(running) == 1:
            def step_seconds(guesses: int) -> float:  # the single loop's t(n): both sides timed alike
                return self.engine.target_call_costs.relative(1 + guesses)
        else:
            return  # a guess would be a verify call of its own beside the batched one
        for request in lone[:guesses_within(len(lone), step_seconds, self.reply_reuse_share)]:
            request.row.proposal = guess(request.state.context, request.state.drafter.propose)
            request.row.situation = GUESS

    @staticmethod
    def _constrain_rows(running: list[BatchRequest]) -> None:
        """Cut every row's drafts to what its grammar accepts and attach the masks of its verify rows (all the
        step's masks in one engine call: loop.constrain)."""
        proposals = constrain([r.state for r in running], [r.row.proposal for r in running])
        for request, proposal in zip(running, proposals):
            request.row.proposal = proposal

    @staticmethod
    def _plan_rows(running: list[BatchRequest], asked: bool) -> None:
        """Give every request this step's row: its plan (none where not `asked`), and what prompt lookup found for
        it (asked first: its proposals are free, so the plan weighs the drafts that exist)."""
        for request in running:
            request.row = RowPlan(*plan(request.state)) if asked else RowPlan()
        for request in running:
            row = request.row
            if row.k > 0 and drafts_free(request.state, row.situation):
                row.looked_up = draft(request.state, row.k)

    def _draft_lengths(self, running: list[BatchRequest], prompt_tokens: int = 0) -> list[int]:
        """Return each request's K this step: the drafts its row offers, unless the batch serves more tokens per
        second without them. `prompt_tokens` of prompt chunks ride the step's call (a ragged-rows one then)."""
        ks = [r.row.offered for r in running]
        if len(running) == 1:
            return ks  # alone: exactly the single-request loop's choice
        candidates, where = [], []
        for i, (request, k) in enumerate(zip(running, ks)):
            if k > 0:
                candidate = draft_candidate(request.opened, request.row.situation, k)
                if candidate.adjustable and draft_lag(request.state, request.row.situation) > MAX_DRAFT_ROOM:
                    # Its draft model would first read all it has not seen (a prefill's cost, every row waiting).
                    ks[i] = 0
                    continue
                if candidate.adjustable:
                    candidate = replace(candidate, kept=request.record.kept(k))
                candidates.append(candidate)
                where.append(i)
        if not candidates:
            return ks
        plain_rows = len(running) - len(candidates)
        if prompt_tokens or self.calls.ragged_mode(running):
            return self._ragged_draft_lengths(ks, candidates, where, plain_rows, prompt_tokens)
        chosen = choose_speculating(candidates, plain_rows, self.calls.batch_costs.seconds,
                                    self.calls.verify_seconds())
        for i, keep in zip(where, chosen):
            if not keep:
                ks[i] = 0
        return ks

    def _ragged_draft_lengths(self, ks: list[int], candidates: list, where: list[int], plain_rows: int,
                              prompt_tokens: int) -> list[int]:
        """Return `ks` with the candidates' K (at `where`) as the batch plan chooses them for one ragged-rows call."""
        calls = self.calls
        plain_step = (calls.ragged_costs.seconds if prompt_tokens or calls.plain_steps_ragged()
                      else calls.batch_costs.seconds)
        lengths = choose_draft_lengths_ragged(
            candidates, plain_rows, lambda tokens: plain_step(tokens + prompt_tokens),
            lambda tokens: calls.ragged_costs.seconds(tokens + prompt_tokens), margin=DRAFT_MARGIN)
        for i, k in zip(where, lengths):
            ks[i] = k
        return ks

    def _drafts_cannot_pay(self, running: list[BatchRequest]) -> bool:
        """Return whether this step skips planning: every request's drafts would need a verify call of its own,
        and none could pay for it even with all accepted (batch_plan.drafts_cannot_pay, on the measured costs).

        Asking each request's policy and prompt lookup costs ~0.5% of a 16-row step on a 2-core CPU (default K);
        where verify calls are cheap (a GPU), the bound does not hold and every step asks. A K a request set is
        always asked.
        """
        if (len(running) < 2 or not self.arena.plain_batches or self.calls.ragged_mode(running)
                or any(r.hidden or (r.state.drafting and not k_gives_way(r.opened)) for r in running)):
            return False
        max_k = max(largest_k(r.state) for r in running)
        return max_k == 0 or drafts_cannot_pay(len(running), max_k, self.calls.batch_costs.seconds,
                                               self.calls.verify_seconds())

    def _score_and_commit(self, running: list[BatchRequest], admitted: list[BatchRequest], start: float) -> None:
        """Make the step's target call and commit every row: one ragged-rows call where prompt chunks ride it or
        rows share it; else a batched decode call for the rows without drafts, a verify call for each other."""
        heads = any(r.hidden for r in running)  # their drafter reads every step's hidden rows
        if admitted or (self.calls.ragged_mode(running) and (
                self.calls.plain_steps_ragged() or heads or any(r.row.proposal.tokens for r in running))):
            self._ragged_step(running, admitted, start)
            return
        # A graph without plain batched calls (int4) runs a lone request's steps as the single-request loop does.
        # The batched decode call returns no hidden rows: a draft head's request takes the single loop's call.
        plain = ([r for r in running if not r.row.proposal.tokens and not r.hidden]
                 if self.arena.plain_batches else [])
        if plain:
            self._batched_step(plain, start)
        for request in running:
            if request not in plain:
                self._guarded(request, lambda r: self._commit_row(self.calls.verify(r)))

    def _ragged_step(self, running: list[BatchRequest], admitted: list[BatchRequest], start: float) -> None:
        """Score every row (and prefill the `admitted` requests' chunks) in ONE ragged-rows call, then commit each
        and start the admitted whose prompt that chunk ended; an error in the call ends all of them."""
        def call_and_commit() -> None:
            prompt_tokens = sum(len(r.chunk) for r in admitted)  # the chunks are taken once fed
            call = self.calls.ragged(running, admitted)
            for row in call.rows:
                self._guarded(row.request, lambda r, row=row: self._commit_row(row))
            for prompt in call.prompts:
                self.prefills_in_steps += self._chunk_fed(prompt.request, prompt.last_logits, prompt.seconds)
            self.calls.observe_ragged(call.tokens, start, prompt_tokens)

        self._guarded_all([*running, *admitted], call_and_commit)

    def _batched_step(self, plain: list[BatchRequest], start: float) -> None:
        """Score the rows without drafts in ONE batched decode call, then commit each; an error in the call ends
        all of them."""
        def call_and_commit() -> None:
            for row in self.calls.batched(plain):
                self._guarded(row.request, lambda r, row=row: self._commit_row(row))
            self.calls.observe_batched(len(plain), start)

        self._guarded_all(plain, call_and_commit)

    def _commit_row(self, row: RowLogits) -> None:
        """Commit one request's row of a target call (the loop's commit rolls its KV back) and deliver it."""
        request = row.request
        rows = 1 + len(request.row.proposal.tokens)
        start = request.cache.length - rows  # the call appended its rows; commit keeps the accepted ones
        iteration = commit(request.state, request.cache, request.row.situation, request.row.proposal,
                           row.logits, row.target_seconds)
        self.arena.scored(request.cache, start, rows)
        self._deliver(request, iteration)


def _guessable(request: BatchRequest) -> bool:
    """Return whether a request may verify a guess this step: it drafts by prompt lookup (a guess is one more
    lookup; a draft model or head keeps its own state), its reply is reusable so far (SlotCache.exact), a
    token is left before max_new_tokens and the position limit, and it is not reproducible (a guess it was not
    given alone would draw its random numbers otherwise)."""
    state = request.state
    return (state.drafting and not request.hidden and not request.opened.config.k_follows_tokens
            and state.drafter.drafts_by_lookup(request.row.situation)
            and request.cache.exact == request.cache.length and draft_room(state) >= 1)
