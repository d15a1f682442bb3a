"""Issue 63 item 4 offline (tiny random llama): `LLM(scheduling_policy="priority")` orders the
waiting queue by `SamplingParams.priority` (lower first; fcfs: arrival order), the priority
travels in the server's `WireParams`, and `LLM(chat_template=...)` renders chats with the
given template; bad values are ValueErrors naming the argument."""

from __future__ import annotations

import pytest

from minisgl.core import SamplingParams
from minisgl.message.schema import AddReq, Codec, WireParams

CARD = "P3-003"
RED = "server-convention-tests-fail-before-the-flags-and-fields-exist"
GREEN = "server-convention-tests-pass"
PRIORITY_ITEM = "priority-is-a-request-field-behind-the-scheduling-policy-flag"
TEMPLATE_ITEM = "the-chat-template-flag-replaces-the-template-of-the-model"
BAD = "bad-input-to-every-new-flag-and-field-is-a-clear-error"

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def waiting_order(llm, priorities: list[int]) -> list[int]:
    rids = [llm.runtime.add([5 + i, 6, 7], SamplingParams(max_tokens=2, priority=p))
            for i, p in enumerate(priorities)]  # fmt: skip
    order = [r.rid for r in llm.scheduler.waiting]
    while llm.has_work():
        llm.step()
    llm.sync()
    return [rids.index(rid) for rid in order]


@pytest.mark.card(CARD, PRIORITY_ITEM, RED, GREEN)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_waiting_queue_follows_the_policy(tiny_model_dir, policy):
    from minisgl import LLM

    llm = LLM(tiny_model_dir("llama"), num_pages=512, max_seq_len_override=128,
              scheduling_policy=policy, cpu_backend="python")  # fmt: skip
    try:
        order = waiting_order(llm, [5, 0, 3, 0, -2])
    finally:
        llm.close()
    assert order == ([4, 1, 3, 2, 0] if policy == "priority" else [0, 1, 2, 3, 4])


PLANES_ITEM = "the-chat-template-and-priority-hold-on-both-control-planes"
PLANES_RED = "failing-tests-the-flags-on-the-rust-service"


@pytest.mark.card(CARD, PLANES_ITEM, PLANES_RED)
@pytest.mark.parametrize("backend", ["python", "rust_service"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_slot_serves_in_the_policys_order_on_both_planes(tiny_model_dir, backend, policy):
    """One request running at a time: the order requests finish in is the waiting queue's,
    whichever process holds it (the Rust service's offline too). A 48-token blocker is
    admitted first, so the five arrive while it runs: the Rust service schedules as requests
    come in over its socket and would otherwise admit the first of them alone (CI at a102498)."""
    from minisgl import LLM

    llm = LLM(tiny_model_dir("llama"), num_pages=512, max_seq_len_override=128,
              scheduling_policy=policy, cpu_backend=backend, max_running_requests=1)  # fmt: skip
    try:
        blocker = llm.runtime.add([1, 2, 3], SamplingParams(max_tokens=48, ignore_eos=True))
        finished: list[int] = []
        while not finished and llm.has_work():  # until the blocker has produced a token
            outs = llm.step()
            finished += [o.rid for o in outs if o.finish_reason is not None]
            if any(o.rid == blocker for o in outs):
                break
        params = [SamplingParams(max_tokens=2, ignore_eos=True, priority=p)
                  for p in (5, 0, 3, 0, -2)]  # fmt: skip
        rids = [llm.runtime.add([5 + i, 6, 7], sp) for i, sp in enumerate(params)]
        while llm.has_work():
            finished += [o.rid for o in llm.step() if o.finish_reason is not None]
        finished += [o.rid for o in llm.sync() if o.finish_reason is not None]
    finally:
        llm.close()
    assert finished[0] == blocker, finished
    order = [rids.index(rid) for rid in finished[1:]]
    assert order == ([4, 1, 3, 2, 0] if policy == "priority" else [0, 1, 2, 3, 4])


@pytest.mark.card(CARD, PRIORITY_ITEM, RED, GREEN)
def test_priority_travels_in_the_wire_params():
    for typed in (True, False):
        codec = Codec(typed=typed)
        msg = codec.decode(codec.encode(AddReq(3, [1, 2], WireParams(priority=-7))))
        assert msg.params.priority == -7
        assert msg.params.to_sampling_params().priority == -7


@pytest.mark.card(CARD, TEMPLATE_ITEM, RED, GREEN)
def test_the_offline_chat_template_renders_chats(tiny_model_dir, tmp_path):
    from minisgl import LLM

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for value in (TEMPLATE, str(f)):
        llm = LLM(tiny_model_dir("llama"), num_pages=256, max_seq_len_override=128,
                  chat_template=value)  # fmt: skip
        try:
            ids = llm.encode(messages)
            assert (
                ids == llm.tokenizer("<user>hi<assistant>yo", add_special_tokens=False)["input_ids"]
            )
        finally:
            llm.close()


@pytest.mark.card(CARD, BAD, RED, GREEN)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority"),
        ({"chat_template": "/no/such/t.jinja"}, "chat_template /no/such/t.jinja: no such file"),
        ({"chat_template": "{% if x %}"}, "chat_template: malformed template"),
    ],
)
def test_bad_llm_arguments_fail_before_loading(kwargs, match):
    from minisgl import LLM

    with pytest.raises(ValueError, match=match):
        LLM("/no/such/model", **kwargs)


@pytest.mark.card(CARD, BAD, RED, GREEN)
@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 1.5, True, "1"])
def test_a_bad_priority_is_a_value_error(priority):
    with pytest.raises(ValueError, match=r"priority must be an int in \[-2147483648, 2147483647\]"):
        SamplingParams(priority=priority)
