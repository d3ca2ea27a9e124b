#!/usr/bin/env python3
"""Plant known bugs one at a time and check that the tests of their area fail.

Each mutation below removes or inverts one deadline, lease, retry, fallback or
reset: an exact source fragment and what replaces it, and the tests meant to catch
it. For each one, a scratch copy of the tree (never the working tree: a crash or a
Ctrl-C must not leave a bug behind) gets that one edit, runs those tests under a
timeout, and gets its file back before the next one. The selections are first run
once without any edit: a selection that fails on its own catches nothing.

    python scripts/mutate.py                 # every mutation (~20 min on 2 busy cores)
    python scripts/mutate.py --group issue27 # one group
    python scripts/mutate.py --only mirror_reset_keeps_entries --only ...
    python scripts/mutate.py --list

A tool to run by hand, not part of CI. "survived" means no selected test failed
with the bug in: either a test is missing or the mutated code is redundant (say
which in benchmark/results/reliability.md). A selection that runs past the timeout
with the bug in counts as caught, flagged "(timeout)": a hang is a failure too,
but a slower one than a test should be.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a test run needs from the tree.
COPIED = ("xinference", "tests", "scripts", "setup.cfg", "pyproject.toml")

X = "xinference/model/llm/vllm/xavier"
T = "tests/model/llm/vllm/xavier"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: paths or node ids
    k: str | None = None  # pytest -k expression
    group: str = "misc"
    note: str = ""  # why it is expected to survive, if it is

    def pytest_args(self) -> list[str]:
        args = list(self.tests)
        if self.k:
            args += ["-k", self.k]
        return args


@dataclass
class Outcome:
    mutation: Mutation
    result: str  # caught | caught (timeout) | survived | not applied | error ...
    caught_by: str = ""
    seconds: float = 0.0
    detail: str = field(default="", repr=False)


MUTATIONS: tuple[Mutation, ...] = (
    # ---- deadlines and cancellation (was scripts/mutate_deadlines.sh) ------------
    Mutation(
        "with_deadline_awaits",
        f"{X}/aio.py",
        "result: T = await xo.wait_for(awaitable, timeout)",
        "result: T = await awaitable",
        (
            f"{T}/connector/test_scheduler.py",
            f"{T}/connector/test_worker_mapping.py",
            f"{T}/test_stalled_peers.py::"
            "test_a_load_from_a_stopped_holder_fails_in_time_and_frees_all"
            "[xoscar-push]",
        ),
        k="hanging or deadline or mapping or xoscar",
        group="deadlines",
    ),
    Mutation(
        "actor_deadline_awaits",
        f"{X}/actor/transfer_actor.py",
        "return await xo.wait_for(call, self._config.rpc_timeout_s)",
        "return await call",
        (f"{T}/test_stalled_peers.py",),
        k="staging",
        group="deadlines",
    ),
    Mutation(
        "serve_push_no_timeout",
        f"{X}/transports/xoscar/gpu_transfer.py",
        "await xo.wait_for(\n"
        "                    xo.copy_to([view], [req.dest]), timeout=self.copy_timeout_s\n"
        "                )",
        "await xo.copy_to([view], [req.dest])",
        (f"{T}/test_stalled_peers.py",),
        k="push_into",
        group="deadlines",
    ),
    Mutation(
        "cpu_read_no_timeout",
        f"{X}/transports/cpu_tier.py",
        "reply = await xo.wait_for(\n"
        "                holder_ref.read_cpu_rows(lease_id, batch), timeout_s\n"
        "            )",
        "reply = await holder_ref.read_cpu_rows(lease_id, batch)",
        (f"{T}/test_stalled_peers.py",),
        k="cpu-tier",
        group="deadlines",
    ),
    Mutation(
        "nixl_read_no_deadline",
        f"{X}/transports/nixl/reads.py",
        "started + timeout_s)",
        "started + 1e9)",
        (f"{T}/test_stalled_peers.py",),
        k="nixl-read",
        group="deadlines",
    ),
    Mutation(
        "release_no_deadline",
        f"{X}/actor/loads.py",
        "await with_deadline(holder.release(req.grant.lease_id), rpc_timeout_s)",
        "await holder.release(req.grant.lease_id)",
        (f"{T}/test_stalled_peers.py",),
        k="cpu-tier",
        group="deadlines",
    ),
    Mutation(
        "finish_even_if_cancelled_abandons",
        f"{X}/aio.py",
        "    task = asyncio.ensure_future(work)\n    cancelled = False",
        "    return await work\n    task = asyncio.ensure_future(work)\n"
        "    cancelled = False",
        (f"{T}/actor/test_parts.py",),
        k="in_flight",
        group="deadlines",
    ),
    Mutation(
        "chunk_row_index_layers_reversed",
        f"{X}/transports/xoscar/gpu_transfer.py",
        "return bases[rows // num_layers] + rows % num_layers",
        "return bases[rows // num_layers] + (num_layers - 1 - rows % num_layers)",
        (f"{T}/transports/test_contract.py",),
        k="every_bf16_bit_pattern",
        group="deadlines",
    ),
    Mutation(
        "xoscar_transport_deadline_only",
        f"{X}/transports/xoscar/transport.py",
        'await with_deadline(holder("push_rows", req), self._context.rpc_timeout_s)',
        'await holder("push_rows", req)',
        (f"{T}/test_stalled_peers.py",),
        k="xoscar",
        group="deadlines",
        note="redundant with LoadRunner._holder_call's deadline: expected to survive",
    ),
    # ---- issue 27: the eight that survived every test of their area --------------
    Mutation(
        "mirror_reset_keeps_entries",
        f"{X}/tracker_mirror.py",
        "            if changes.reset:\n                self._index.clear()\n",
        "",
        (f"{T}/test_tracker_mirror.py",),
        group="issue27",
    ),
    Mutation(
        "forget_keeps_key_set",
        f"{X}/prefix_index.py",
        "for key in self._blocks_of.pop(rank, ()):",
        "for key in self._blocks_of.get(rank, ()):",
        (f"{T}/test_tracker.py", f"{T}/test_tracker_mirror.py"),
        group="issue27",
    ),
    Mutation(
        "late_reservation_not_released_when_given_up",
        f"{X}/connector/reservations.py",
        "return error is None or isinstance(error, TimeoutError)",
        "return error is None",
        (f"{T}/connector/test_scheduler.py",),
        group="issue27",
    ),
    Mutation(
        "late_reservation_not_released_by_the_loop",
        f"{X}/connector/reservations.py",
        "            if not pending.answered():\n"
        "                await self._release_within_deadline(hit, lease_id)\n"
        "            raise\n",
        "            pending.answered()\n            raise\n",
        (f"{T}/connector/test_scheduler.py",),
        group="issue27",
    ),
    Mutation(
        "timed_out_ring_slots_reused",
        f"{X}/connector/write_behind.py",
        "                ring.retire(staging.slots)\n",
        "                ring.give_back(staging.slots)\n",
        (f"{T}/connector/test_worker.py",),
        k="ring",
        group="issue27",
    ),
    Mutation(
        "raising_fallback_escapes",
        f"{X}/connector/faults.py",
        "            return True\n        except Exception as exc:",
        "            return True\n        except ZeroDivisionError as exc:",
        (f"{T}/connector/test_vllm_facade.py", f"{T}/connector/test_faults.py"),
        group="issue27",
    ),
    Mutation(
        "raising_report_escapes",
        f"{X}/connector/faults.py",
        "            except Exception as report_exc:",
        "            except ZeroDivisionError as report_exc:",
        (f"{T}/connector/test_vllm_facade.py", f"{T}/connector/test_faults.py"),
        group="issue27",
    ),
    Mutation(
        "failed_fallback_blocks_never_reported",
        f"{X}/connector/vllm_facade.py",
        "        if not self._unreported_failures:\n            return step\n",
        "        return step\n",
        (f"{T}/connector/test_vllm_facade.py",),
        group="issue27",
    ),
    Mutation(
        "failed_fallback_reported_as_done",
        f"{X}/connector/faults.py",
        "            return False\n",
        "            return True\n",
        (f"{T}/connector/test_faults.py", f"{T}/connector/test_vllm_facade.py"),
        group="issue27",
    ),
    Mutation(
        "abandon_load_releases_before_reporting",
        f"{X}/connector/scheduler.py",
        "        state = self._requests.get(req_id)\n"
        "        asynchronous = self._settings.load_async\n",
        "        self.drop_reservation(req_id)\n"
        "        state = self._requests.get(req_id)\n"
        "        asynchronous = self._settings.load_async\n",
        (f"{T}/connector/test_scheduler.py",),
        k="abandoned",
        group="issue27",
    ),
    Mutation(
        "stream_resent_after_output",
        "xinference/core/dispatch.py",
        "retry = None if produced else await self._reroute(failed, route)",
        "retry = await self._reroute(failed, route)",
        ("tests/core/test_dispatch.py",),
        group="issue27",
    ),
    Mutation(
        "new_dispatcher_ignores_gone",
        "xinference/core/dispatch.py",
        "self.gone: dict[int, str] = dict(deployment.gone)",
        "self.gone: dict[int, str] = {}",
        ("tests/core/test_dispatch.py",),
        group="issue27",
    ),
    Mutation(
        "stall_threshold_four_times_late",
        "xinference/core/heartbeat.py",
        "if late > settings.timeout_s / 2:",
        "if late > settings.timeout_s * 2:",
        ("tests/core/test_heartbeat.py",),
        group="issue27",
    ),
    Mutation(
        "stall_threshold_four_times_early",
        "xinference/core/heartbeat.py",
        "if late > settings.timeout_s / 2:",
        "if late > settings.timeout_s / 8:",
        ("tests/core/test_heartbeat.py",),
        group="issue27",
    ),
    # ---- issue 28: the asynchronous path posts, completions are pushed -----------
    Mutation(
        "async_post_waits_for_the_load",
        f"{X}/connector/load_completions.py",
        "            self._loop.submit(self._run(actor, req))\n",
        "            self._loop.submit(self._run(actor, req)).result()\n",
        (f"{T}/connector/test_worker_async_loads.py",),
        k="returns_before",
        group="issue28",
    ),
    Mutation(
        "async_run_load_no_deadline",
        f"{X}/connector/load_completions.py",
        "deadline = self._load_timeout_s + 2 * self._rpc_timeout_s",
        "deadline = 3600.0",
        (f"{T}/connector/test_worker_async_loads.py",),
        k="stops_answering",
        group="issue28",
    ),
    Mutation(
        "async_failed_call_not_reported",
        f"{X}/connector/load_completions.py",
        'outcome = f"run_load failed: {type(exc).__name__}: {exc}"',
        "return",
        (f"{T}/connector/test_worker_async_loads.py",),
        k="refuses",
        group="issue28",
    ),
    Mutation(
        "async_aborted_load_not_cancelled",
        f"{X}/connector/load_completions.py",
        "if load.req_id not in aborted or load.cancel_posted:",
        "if True:",
        (f"{T}/connector/test_worker_async_loads.py",),
        k="aborted",
        group="issue28",
    ),
    Mutation(
        "run_load_not_cancelled_at_its_deadline",
        f"{X}/actor/loads.py",
        "            await self.cancel(load_id)\n"
        "            return await self.wait(load_id, 0)\n",
        "            raise\n",
        (f"{T}/actor/test_bounded_loads.py",),
        k="deadline",
        group="issue28",
    ),
    # ---- issue 48: tenants and abuse ------------------------------------------
    Mutation(
        "login_counted_after_the_check",
        "xinference/api/auth/service.py",
        '        attempt = self.throttle.admit([user_key, f"addr:{client_host}"])\n'
        "        if not isinstance(attempt, Attempt):\n"
        "            raise Throttled(attempt)\n"
        "        user = await asyncio.to_thread("
        "self.store.verify_password, username, password)\n"
        "        if user is None:\n"
        '            raise Unauthorized("wrong username or password")\n',
        '        keys = [user_key, f"addr:{client_host}"]\n'
        "        probe = self.throttle.admit(keys)\n"
        "        if not isinstance(probe, Attempt):\n"
        "            raise Throttled(probe)\n"
        "        self.throttle.succeeded(probe, clear=[])\n"
        "        user = await asyncio.to_thread("
        "self.store.verify_password, username, password)\n"
        "        attempt = probe\n"
        "        if user is None:\n"
        "            self.throttle.admit(keys)\n"
        '            raise Unauthorized("wrong username or password")\n',
        ("tests/api/auth/test_login_throttle.py",),
        k="burst",
        group="issue48",
    ),
    Mutation(
        "login_throttled_per_user_only",
        "xinference/api/auth/service.py",
        'self.throttle.admit([user_key, f"addr:{client_host}"])',
        "self.throttle.admit([user_key])",
        ("tests/api/auth/test_login_throttle.py",),
        group="issue48",
    ),
    Mutation(
        "login_failures_never_leave_the_window",
        "xinference/api/auth/throttle.py",
        "        while failures and failures[0] <= now - self.window_s:\n",
        "        while False:\n",
        ("tests/api/auth/test_login_throttle.py",),
        group="issue48",
    ),
    Mutation(
        "login_success_clears_the_address",
        "xinference/api/auth/service.py",
        "self.throttle.succeeded(attempt, clear=[user_key])",
        "self.throttle.succeeded(attempt, clear=list(attempt.keys))",
        ("tests/api/auth/test_login_throttle.py",),
        group="issue48",
    ),
    Mutation(
        "user_manager_grants_anything",
        "xinference/api/auth/routes.py",
        "beyond = set(body.permissions) - set(caller.permissions)",
        "beyond: set[str] = set()",
        ("tests/api/auth/test_user_management.py",),
        group="issue48",
    ),
    Mutation(
        "head_of_a_public_route_needs_a_credential",
        "xinference/api/auth/permissions.py",
        '    method = "GET" if method == "HEAD" else method\n'
        "    return (method, path) in PUBLIC_ROUTES",
        "    return (method, path) in PUBLIC_ROUTES",
        ("tests/api/auth/test_route_permissions.py",),
        k="head",
        group="issue48",
    ),
    Mutation(
        "no_request_size_limit",
        "xinference/api/restful_api.py",
        "    app.add_middleware(BodyLimit, max_bytes=options.max_request_bytes)\n",
        "",
        ("tests/api/test_body_limit.py",),
        group="issue48",
    ),
    Mutation(
        "chunked_body_not_counted",
        "xinference/api/body_limit.py",
        "            if size > self.max_bytes:\n",
        "            if False:\n",
        ("tests/api/test_body_limit.py",),
        group="issue48",
    ),
    Mutation(
        "prompt_tokenised_whatever_its_length",
        "xinference/core/prompting.py",
        "self._bound: CharBound | None = chars_per_token(tokenizer)",
        "self._bound: CharBound | None = None",
        ("tests/core/test_prompting.py", "tests/api/test_prompt_abuse.py"),
        group="issue48",
    ),
    Mutation(
        "one_tokenizer_for_every_thread",
        "xinference/core/prompting.py",
        "self._size = max(size, 1)",
        "self._size = 1",
        ("tests/core/test_prompting.py",),
        k="wait",
        group="issue48",
    ),
    Mutation(
        "lone_surrogate_reaches_the_tokenizer",
        "xinference/core/prompting.py",
        "    if text.isascii():\n        return\n",
        "    return\n",
        ("tests/api/test_prompt_abuse.py",),
        k="surrogate",
        group="issue48",
    ),
    Mutation(
        "nfc_composition_not_counted",
        "xinference/core/prompt_bounds.py",
        "            factor = COMPOSITION_FACTOR\n",
        "            factor = 1\n",
        ("tests/core/test_prompt_bounds.py",),
        group="issue48",
    ),
    Mutation(
        "error_quoting_a_surrogate_fails",
        "xinference/api/errors.py",
        "    @app.exception_handler(RequestValidationError)\n",
        "    @app.exception_handler(KeyboardInterrupt)\n",
        ("tests/api/test_prompt_abuse.py",),
        k="quoting",
        group="issue48",
    ),
    Mutation(
        "salt_not_in_the_root",
        f"{X}/hashing.py",
        "    if salt:\n        seed += _prefixed(salt)\n",
        "",
        (f"{T}/test_hashing.py", f"{T}/connector/test_cache_salt.py"),
        group="issue48",
    ),
    Mutation(
        "salt_not_in_the_prompts_keys",
        f"{X}/connector/request_state.py",
        "keys = hash_full_blocks(prompt, block_size, namespace, cache_salt)",
        "keys = hash_full_blocks(prompt, block_size, namespace)",
        (f"{T}/connector/test_cache_salt.py",),
        group="issue48",
    ),
    Mutation(
        "salt_not_in_the_generated_keys",
        f"{X}/connector/scheduler.py",
        "                    self._settings.namespace,\n"
        "                    state.cache_salt,\n",
        "                    self._settings.namespace,\n",
        (f"{T}/connector/test_cache_salt.py",),
        group="issue48",
    ),
    Mutation(
        "salt_not_read_from_vllm",
        f"{X}/connector/vllm_facade.py",
        "cache_salt=request.cache_salt,",
        "cache_salt=None,",
        (f"{T}/connector/test_cache_salt.py",),
        group="issue48",
    ),
    Mutation(
        "salt_not_sent_to_vllm",
        "xinference/core/vllm_engine.py",
        '            prompt["cache_salt"] = request.cache_salt\n',
        "            pass\n",
        ("tests/core/test_vllm_engine_requests.py",),
        group="issue48",
    ),
    Mutation(
        "salt_not_routed",
        "xinference/core/dispatch.py",
        "holder, blocks = await self._longest_prefix(prompt_token_ids, cache_salt)",
        "holder, blocks = await self._longest_prefix(prompt_token_ids, None)",
        ("tests/core/test_dispatch.py",),
        k="salt",
        group="issue48",
    ),
    Mutation(
        "requests_not_salted_by_caller",
        "xinference/api/tenancy.py",
        "        scope = self._scope(principal)\n",
        "        scope = None\n",
        ("tests/api/test_cache_salt.py",),
        group="issue48",
    ),
    Mutation(
        "bad_salt_accepted",
        "xinference/api/tenancy.py",
        "    bad = (\n",
        "    bad = False and (\n",
        ("tests/api/test_cache_salt.py",),
        group="issue48",
    ),
    Mutation(
        "output_handler_cancelled_last",
        "xinference/core/vllm_engine.py",
        "            handler.cancel()\n"
        "            await asyncio.gather(handler, return_exceptions=True)\n",
        "            pass\n",
        ("tests/core/test_vllm_engine_shutdown.py",),
        group="issue48",
    ),
    Mutation(
        "engine_core_killed_before_its_workers_exit",
        "xinference/core/vllm_engine.py",
        "engine.shutdown(timeout=ENGINE_EXIT_TIMEOUT_S)",
        "engine.shutdown()",
        ("tests/core/test_vllm_engine_shutdown.py",),
        group="issue48",
        note="with real engines: tests/api/test_tenancy_engines.py (vllm marker)",
    ),
    Mutation(
        "requests_running_at_shutdown_not_aborted",
        "xinference/core/model.py",
        "        for task in list(self._generating):\n            task.cancel()\n",
        "",
        ("tests/core/test_vllm_engine_shutdown.py",),
        group="issue48",
    ),
    # ---- issue 49: fast-path reads, how loads end, the relay, auth --------------
    Mutation(
        "failed_meeting_never_retried",
        f"{X}/connector/direct_reads.py",
        "if meeting is not None and not (meeting.done() and meeting.exception()):",
        "if meeting is not None:",
        (f"{T}/connector/test_direct_reads.py",),
        k="met_again",
        group="issue49",
    ),
    Mutation(
        "lease_free_step_waits_the_smallest_bound",
        f"{X}/connector/direct_reads.py",
        "bound_s = max((item.bound_s or 0.0) for item in lease_free)",
        "bound_s = min((item.bound_s or 0.0) for item in lease_free)",
        (f"{T}/connector/test_direct_reads.py",),
        k="largest_bound",
        group="issue49",
    ),
    Mutation(
        "never_started_async_load_never_finished",
        f"{X}/connector/load_outcomes.py",
        "        if asynchronous:  # vLLM waits for it in get_finished\n"
        "            self._finished_recving.add(req_id)\n",
        "",
        (f"{T}/connector/test_worker_unfinished_loads.py",),
        group="issue49",
    ),
    Mutation(
        "never_started_sync_load_reported_finished",
        f"{X}/connector/load_outcomes.py",
        "        if asynchronous:  # vLLM waits for it in get_finished\n",
        "        if True:\n",
        (f"{T}/connector/test_worker_unfinished_loads.py",),
        group="issue49",
    ),
    Mutation(
        "never_started_load_blocks_not_failed",
        f"{X}/connector/load_outcomes.py",
        "        self._load_errors.update(block_ids)\n",
        "",
        (f"{T}/connector/test_worker_unfinished_loads.py",),
        group="issue49",
    ),
    Mutation(
        "sync_load_past_the_worker_deadline_not_cancelled",
        f"{X}/connector/worker.py",
        "                self._run_actor(\n"
        "                    self._cancel_all(late), self._settings.rpc_timeout_s * 2\n"
        "                )\n",
        "",
        (f"{T}/connector/test_worker_unfinished_loads.py",),
        group="issue49",
    ),
    Mutation(
        "sync_load_whose_wait_failed_not_cancelled",
        f"{X}/connector/worker.py",
        "                await self._cancel_quietly(load_id)\n"
        '                self._loads.ended(load_id, f"wait failed: {exc!r}")\n',
        '                self._loads.ended(load_id, f"wait failed: {exc!r}")\n',
        (f"{T}/connector/test_worker_unfinished_loads.py",),
        group="issue49",
    ),
    Mutation(
        "relay_numbers_records_that_do_not_match",
        f"{X}/tracker_relay.py",
        "elif len(records) != answer.version - self._version:",
        "elif False:",
        (f"{T}/test_tracker_relay.py",),
        k="do_not_match",
        group="issue49",
    ),
    Mutation(
        "mirror_below_the_relays_base_told_nothing_new",
        f"{X}/tracker_relay.py",
        "if since < 0 or self._base < 0 or since < self._base:",
        "if since < 0 or self._base < 0:",
        (f"{T}/test_tracker_relay.py",),
        k="log_base",
        group="issue49",
    ),
    Mutation(
        "grant_used_past_a_differing_key",
        f"{X}/connector/reservations.py",
        "        if got != want:\n            break\n",
        "        if got != want:\n            continue\n",
        (f"{T}/connector/test_scheduler.py",),
        k="differs",
        group="issue49",
    ),
    Mutation(
        "grant_not_truncated_to_its_matching_keys",
        f"{X}/connector/reservations.py",
        "        if usable < len(grant.keys):\n",
        "        if False:\n",
        (f"{T}/connector/test_scheduler.py",),
        k="differs",
        group="issue49",
    ),
    Mutation(
        "login_failures_kept_twice_the_window",
        "xinference/api/auth/throttle.py",
        "while failures and failures[0] <= now - self.window_s:",
        "while failures and failures[0] <= now - 2 * self.window_s:",
        ("tests/api/auth/test_login_throttle.py",),
        k="window",
        group="issue49",
    ),
    Mutation(
        "login_limit_checked_on_the_first_key_only",
        "xinference/api/auth/throttle.py",
        "        for key in keys:\n            failures = self._recent(key, now)\n",
        "        for key in keys[:1]:\n            failures = self._recent(key, now)\n",
        ("tests/api/auth/test_login_throttle.py",),
        k="many_user_names",
        group="issue49",
    ),
    Mutation(
        "unlisted_route_needs_only_models_list",
        "xinference/api/auth/permissions.py",
        "return ROUTE_PERMISSIONS.get((method, path), ADMIN)",
        "return ROUTE_PERMISSIONS.get((method, path), MODELS_LIST)",
        ("tests/api/auth/test_route_permissions.py",),
        k="every_route or added_later",
        group="issue49",
    ),
    Mutation(
        "tp_close_stops_at_the_first_failed_rank",
        f"{X}/actor/rank_group.py",
        "        results = await asyncio.gather(\n"
        "            *(ref.close() for ref in self.refs), return_exceptions=True\n"
        "        )\n",
        "        results = [await ref.close() for ref in self.refs]\n",
        (f"{T}/actor/test_tensor_parallel_actors.py",),
        k="closing",
        group="issue49",
    ),
    Mutation(
        "tp_close_failure_swallowed",
        f"{X}/actor/rank_group.py",
        "        if failure is not None:\n            raise failure\n",
        "",
        (f"{T}/actor/test_tensor_parallel_actors.py",),
        k="closing",
        group="issue49",
    ),
    # ---- this tool's own machinery --------------------------------------------
    Mutation(
        "planted_file_never_restored",
        "scripts/mutate.py",
        "    finally:\n        path.write_bytes(original)\n",
        "    finally:\n        pass\n",
        ("tests/scripts/test_mutate.py",),
        group="tool",
    ),
)


# ---- machinery ------------------------------------------------------------------


def copy_tree(source: Path, dest: Path) -> None:
    """The parts of the repository a test run needs, without caches."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        path = source / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, dest / name)


@contextlib.contextmanager
def planted(tree: Path, mutation: Mutation) -> Iterator[None]:
    """``mutation`` applied to ``tree`` (a scratch copy) for the duration; the file's
    original bytes are back afterwards, whatever happened inside. Raises
    ``ValueError`` when the fragment is not in the file exactly once (the code it
    names has changed: the table needs updating)."""
    path = tree / mutation.file
    original = path.read_bytes()
    text = original.decode()
    found = text.count(mutation.old)
    if found != 1:
        raise ValueError(
            f"{mutation.name}: the fragment occurs {found} times in {mutation.file}"
        )
    path.write_text(text.replace(mutation.old, mutation.new))
    try:
        yield
    finally:
        path.write_bytes(original)


def run_tests(
    tree: Path, args: Sequence[str], timeout_s: float, python: str
) -> tuple[int | None, str]:
    """(pytest's exit status or None on timeout, its output)."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    command = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf"]
    # Its own process group: on a timeout the pools it started go with it.
    child = subprocess.Popen(
        [*command, *args],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        return None, output
    except BaseException:  # Ctrl-C: its own session does not get the signal
        os.killpg(child.pid, signal.SIGKILL)
        raise
    return child.returncode, output


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def first_failure(output: str) -> str:
    match = _FAILED.search(output)
    return match.group(1).split("::", 1)[-1] if match else ""


def judge(mutation: Mutation, status: int | None, output: str) -> Outcome:
    if status is None:
        return Outcome(mutation, "caught (timeout)", detail=output)
    if status == 0 and not re.search(r"\b[1-9]\d* passed", output):
        return Outcome(mutation, "not run (every test skipped)", detail=output)
    if status == 0:
        return Outcome(mutation, "survived", detail=output)
    if status == 1:
        return Outcome(mutation, "caught", first_failure(output), detail=output)
    if status == 5:
        return Outcome(mutation, "error: no test selected", detail=output)
    return Outcome(mutation, f"error: pytest exit {status}", detail=output)


def check(
    tree: Path, mutations: Sequence[Mutation], timeout_s: float, python: str
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    baseline: dict[tuple[str, ...], str] = {}
    for mutation in mutations:
        key = tuple(mutation.pytest_args())
        if key not in baseline:
            status, output = run_tests(tree, key, timeout_s, python)
            baseline[key] = (
                "" if status == 0 else first_failure(output) or f"pytest exit {status}"
            )
            if status != 0:
                print(output[-3000:], file=sys.stderr)
        started = time.monotonic()
        if baseline[key]:
            outcome = Outcome(mutation, "baseline fails", baseline[key])
        else:
            try:
                with planted(tree, mutation):
                    status, output = run_tests(tree, key, timeout_s, python)
            except ValueError as exc:
                outcome = Outcome(mutation, "not applied", str(exc))
            else:
                outcome = judge(mutation, status, output)
        outcome.seconds = time.monotonic() - started
        outcomes.append(outcome)
        print(f"  {mutation.name}: {outcome.result} {outcome.caught_by}", flush=True)
    return outcomes


def table(outcomes: Sequence[Outcome]) -> str:
    rows = [("mutation", "file", "result", "caught by", "s")]
    for o in outcomes:
        file = o.mutation.file.removeprefix(X + "/")
        by = o.caught_by or o.mutation.note
        rows.append((o.mutation.name, file, o.result, by, f"{o.seconds:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "| "
        + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    caught = sum(o.result.startswith("caught") for o in outcomes)
    lines.append(f"\n{caught} of {len(outcomes)} caught")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="NAME")
    parser.add_argument("--group", action="append", default=[])
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S")
    parser.add_argument("--python", default=os.environ.get("PYTHON", sys.executable))
    options = parser.parse_args(argv)
    chosen = [
        m
        for m in MUTATIONS
        if (not options.only or m.name in options.only)
        and (not options.group or m.group in options.group)
    ]
    unknown = set(options.only) - {m.name for m in MUTATIONS}
    if unknown or not chosen:
        parser.error(f"no such mutation: {', '.join(sorted(unknown)) or '(none left)'}")
    if options.list:
        for m in chosen:
            print(f"{m.group:10} {m.name:45} {m.file}")
        return 0
    with tempfile.TemporaryDirectory(prefix="xavier-mutate-") as scratch:
        tree = Path(scratch)
        copy_tree(ROOT, tree)
        outcomes = check(tree, chosen, options.timeout, options.python)
    print(table(outcomes))
    expected_survivors = {o.mutation.name for o in outcomes if o.mutation.note}
    bad = [
        o
        for o in outcomes
        if not o.result.startswith("caught")
        and o.mutation.name not in expected_survivors
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
