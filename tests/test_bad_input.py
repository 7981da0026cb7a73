"""Bad input at live servers, and the limits that bound what one caller may take.

Property-based (hypothesis, fixed seed): malformed and extreme requests at every RPC
of the three services over real gRPC, including the internal Draft and Target ones,
and raw bytes that are not the request message at all. Each must get OK or a status
code that says what was wrong (never INTERNAL or UNKNOWN) with a message; afterwards
the services still serve the same output, and a session that lived through the storm
(a "bystander") is untouched in Redis. A background client generates throughout and
checks that its output never changes."""

import collections
import struct
import zlib
import threading
import time

import grpc
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from conftest import internal_stub, start_stack
from specdec.session import meta_key, tokens_key
from specdec.v1 import specdec_pb2 as pb

PROMPT = "hello world"
MAX_NEW_TOKENS_LIMIT = 8
MAX_PROMPT_TOKENS = 48
# Codes that tell the caller what was wrong with its request, or that it must wait.
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
BYSTANDER = "bystander-session"


@pytest.fixture(scope="module")
def stack(redis_url, tiny_models):
    stack = start_stack(
        redis_url, tiny_models.target, tiny_models.draft,
        coordinator_args=["--max-new-tokens-limit", str(MAX_NEW_TOKENS_LIMIT),
                          "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--default-max-new-tokens", "4",
                          "--max-concurrent-requests", "4"],
        target_args=["--max-k", "4", "--max-sessions", "32"],
        draft_args=["--max-k", "5", "--max-sessions", "32"],
    )  # fmt: skip
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    with specdec.Client(stack.address) as client:
        yield client


@pytest.fixture(scope="module")
def reference(client, redis_url):
    """The greedy output before any fuzzing, and a finished bystander session's Redis state."""
    options = dict(max_new_tokens=MAX_NEW_TOKENS_LIMIT, ignore_eos=True, num_speculative_tokens=3)
    output = client.generate(PROMPT, **options).token_ids
    client.generate(PROMPT, session_id=BYSTANDER, **options)
    store = redis.Redis.from_url(redis_url, decode_responses=True)
    bystander = (store.lrange(tokens_key(BYSTANDER), 0, -1), store.hgetall(meta_key(BYSTANDER)))
    return output, options, bystander, store


class Watcher:
    """Generates greedily in the background and records any output that differs."""

    def __init__(self, address, expected, options):
        self.expected, self.options = expected, options
        self.address = address
        self.stop = threading.Event()
        self.runs = 0
        self.failures = []
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        with specdec.Client(self.address) as client:
            while not self.stop.is_set():
                try:
                    got = client.generate(PROMPT, **self.options).token_ids
                    if got != self.expected:
                        self.failures.append(f"output changed: {got}")
                except specdec.SpecdecClientError as exc:
                    if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # the fuzz may fill the slots
                        self.failures.append(f"{exc.code.name}: {exc.message}")
                self.runs += 1
                time.sleep(0.05)

    def finish(self):
        self.stop.set()
        self.thread.join(timeout=60)
        return self.runs, self.failures


@pytest.fixture(scope="module")
def committed(reference):
    """The bystander session's committed token ids."""
    return [int(t) for t in reference[2][0]]


@pytest.fixture
def storm(stack, client, reference):
    """Around each fuzz test: a watcher generating throughout, then checks that the
    services serve the reference output, the bystander is untouched and no process died."""
    expected, options, bystander, store = reference
    watcher = Watcher(stack.address, expected, options)
    outcomes = collections.Counter()
    yield outcomes
    runs, failures = watcher.finish()
    assert not failures, failures[:3]
    assert runs > 0
    assert all(p.poll() is None for p in stack.processes.values()), "a service process died"
    assert client.generate(PROMPT, **options).token_ids == expected
    assert (store.lrange(tokens_key(BYSTANDER), 0, -1), store.hgetall(meta_key(BYSTANDER))) == bystander
    # Not vacuous: the fuzz reached the servers, and both accepted and refused requests.
    assert sum(outcomes.values()) >= 100 and outcomes["OK"] > 0 and len(outcomes) >= 2, outcomes
    print(f"fuzz outcomes: {dict(outcomes)}")


def record(outcomes, call):
    """Run one RPC; check its status is acceptable and that a refusal says why."""
    try:
        call()
        outcomes["OK"] += 1
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ACCEPTABLE, f"{code.name}: {exc.details()}"
        assert exc.details(), f"{code.name} without a message"
        outcomes[code.name] += 1


# ---------------------------------------------------------------- strategies
#
# Each field is mostly valid and sometimes wild, so that requests reach past the first
# check: a fully random request is refused for its first bad field and tests little.


def mostly(valid, wild):
    """`valid` 70% of the time, else `wild`."""
    return st.integers(0, 9).flatmap(lambda i: wild if i < 3 else valid)


int32 = st.integers(-(2**31), 2**31 - 1)
small_ints = st.one_of(st.integers(-3, 70), int32)
vocab_ids = st.integers(0, 39)  # the tiny tokenizer's vocabulary has ~40 tokens
token_ids = mostly(st.lists(vocab_ids, min_size=1, max_size=12), st.lists(st.one_of(vocab_ids, int32), max_size=70))
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
odd_text = st.text(max_size=80) | st.text(min_size=700, max_size=1200)
wild_session_ids = st.one_of(
    st.text(max_size=30), st.text(min_size=200, max_size=300), st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True),
    st.text(st.characters(categories=("L", "N", "Zs", "P")), min_size=1, max_size=20),  # printable, not ASCII only
    st.just("a{b}c"), st.just(""),
)  # fmt: skip


@st.composite
def sampling_params(draw, seed_required=False):
    msg = pb.SamplingParams(top_k=draw(mostly(st.sampled_from([0, 5]), int32)))
    if draw(st.booleans()):
        msg.temperature = draw(mostly(st.sampled_from([0.0, 1.0, 0.7]), floats))
    if draw(st.booleans()):
        msg.top_p = draw(mostly(st.sampled_from([1.0, 0.9]), floats))
    if draw(mostly(st.just(seed_required), st.booleans())):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@st.composite
def generate_requests(draw):
    msg = pb.GenerateRequest(
        stop=draw(mostly(st.just([]), st.lists(st.text(max_size=5), max_size=3))),
        session_id=draw(mostly(st.just(""), st.one_of(st.just(BYSTANDER), wild_session_ids))),
        ignore_eos=draw(st.booleans()),
        sampling=draw(sampling_params()),
    )
    text_prompt = draw(st.booleans())
    if text_prompt or draw(st.integers(0, 9)) == 0:
        msg.prompt = draw(mostly(st.sampled_from(["hello world", "the cat", "abc"]), odd_text))
    if not text_prompt or draw(st.integers(0, 9)) == 0:
        msg.prompt_token_ids.extend(draw(token_ids))
    if draw(st.booleans()):
        msg.max_new_tokens = draw(mostly(st.integers(1, MAX_NEW_TOKENS_LIMIT), small_ints))
    spec = msg.speculation
    if draw(st.booleans()):
        spec.num_speculative_tokens = draw(mostly(st.integers(1, 4), small_ints))
    spec.disabled = draw(mostly(st.just(False), st.booleans()))
    spec.adaptive = draw(st.booleans())
    if draw(st.booleans()):
        spec.pipeline = draw(st.booleans())
    return msg


@st.composite
def q_of(draw, token_id):
    """A draft token's q: mostly a distribution that holds the token, sometimes anything."""
    form = draw(st.sampled_from(["sparse", "fixed", "fixed_deflated", "dense32", "dense16", "one_hot", "none"]))
    msg = pb.DraftToken()
    if form == "fixed":
        pair = sorted({token_id % 40, (token_id + 1) % 40})
        gaps = [pair[0]] + [b - a for a, b in zip(pair, pair[1:])]
        uint32 = st.integers(0, 2**32 - 1)
        msg.fixed.id_gaps.extend(draw(mostly(st.just(gaps), st.lists(uint32, max_size=8))))
        msg.fixed.weights.extend(draw(mostly(st.just([196608, 65536][: len(gaps)]), st.lists(uint32, max_size=9))))
    elif form == "fixed_deflated":
        pair = sorted({token_id % 40, (token_id + 1) % 40})
        gaps = [pair[0]] + [b - a for a, b in zip(pair, pair[1:])]
        good = zlib.compress(pb.FixedProbs(id_gaps=gaps, weights=[196608, 65536][: len(gaps)]).SerializeToString())
        msg.fixed_deflated = draw(mostly(st.just(good), st.binary(max_size=64)))
    elif form == "sparse":
        ids = draw(mostly(st.just([token_id, (token_id + 1) % 40]), st.lists(st.one_of(vocab_ids, int32), max_size=8)))
        probs = draw(mostly(st.just([0.75, 0.25][: len(ids)]), st.lists(floats, max_size=9)))
        msg.sparse.ids.extend(ids)
        msg.sparse.probs.extend(probs)
    elif form == "dense32":
        msg.dense.probs.extend(draw(mostly(st.just([1.0 / 40] * 40), st.lists(floats, max_size=50))))
    elif form == "dense16":
        uniform = struct.pack("<40e", *([1.0 / 40] * 40))
        msg.dense.fp16 = draw(mostly(st.just(uniform), st.binary(max_size=100)))
    elif form == "one_hot":
        msg.one_hot.SetInParent()
    return msg


@st.composite
def draft_tokens(draw):
    token_id = draw(mostly(vocab_ids, int32))
    msg = draw(q_of(token_id))
    msg.token_id = token_id
    msg.index = draw(st.integers(0, 20))
    return msg


@st.composite
def internal_fields(draw, committed):
    """Session, position and new tokens: mostly a true continuation of the bystander's
    committed tokens, sometimes anything."""
    position = draw(mostly(st.integers(0, len(committed) - 1), small_ints))
    valid_new = st.just(committed[position : position + 2] if 0 <= position < len(committed) else [1])
    return dict(
        session_id=draw(mostly(st.just(BYSTANDER), wild_session_ids)),
        position=position,
        new_tokens=draw(mostly(valid_new, token_ids)),
        sampling=draw(sampling_params(seed_required=True)),
        cycle=draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def verify_requests(draw, committed):
    msg = pb.VerifyRequest(**draw(internal_fields(committed)), drafts=draw(st.lists(draft_tokens(), max_size=5)))
    msg.draft_fingerprint = draw(mostly(st.just(""), st.sampled_from(["0" * 64, "not-a-fingerprint"])))
    msg.draft_model = draw(st.text(max_size=20))
    msg.steps = draw(mostly(st.integers(0, 5), st.integers(0, 2**32 - 1)))
    msg.draft_busy = draw(st.booleans())
    if draw(st.booleans()):  # plain steps that stop at an n-gram match: mostly sane bounds
        uint32 = st.integers(0, 2**32 - 1)
        msg.stop_at_ngram.min_ngram = draw(mostly(st.integers(1, 3), uint32))
        msg.stop_at_ngram.max_ngram = draw(mostly(st.integers(3, 5), uint32))
    return msg


@st.composite
def propose_requests(draw, committed):
    return pb.ProposeRequest(**draw(internal_fields(committed)), k=draw(mostly(st.integers(1, 5), small_ints)))


def wire_garbage():
    """Bytes that are not the expected message: random, or valid protobuf framing with
    field numbers the messages use but wire types they do not."""
    random_bytes = st.binary(max_size=200)

    @st.composite
    def mistyped(draw):
        out = b""
        for _ in range(draw(st.integers(1, 6))):
            field = draw(st.integers(1, 10))
            wire = draw(st.sampled_from([0, 1, 2, 5]))
            out += bytes([(field << 3) | wire])
            if wire == 0:
                out += bytes([0xFF] * draw(st.integers(0, 9))) + b"\x01"
            elif wire == 1:
                out += struct.pack("<d", draw(st.floats(allow_nan=True)))
            elif wire == 2:
                payload = draw(st.binary(max_size=20))
                out += bytes([len(payload)]) + payload
            else:
                out += struct.pack("<f", draw(st.floats(width=32, allow_nan=True)))
        return out

    return st.one_of(random_bytes, mistyped())


# ---------------------------------------------------------------- fuzz tests


@pytest.fixture(scope="module")
def stubs(stack):
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(stack.address)
    yield {
        "coordinator": pb_grpc.CoordinatorStub(channel),
        "draft": internal_stub(stack, "draft"),
        "target": internal_stub(stack, "target"),
    }
    channel.close()


@settings(max_examples=300, **FUZZ)
@given(request=generate_requests())
def test_fuzzed_generate_requests_get_a_clear_status_and_disturb_nobody(stubs, storm, request):
    record(storm, lambda: list(stubs["coordinator"].Generate(request, timeout=30)))


@settings(max_examples=100, **FUZZ)
@given(
    session_id=mostly(st.just(BYSTANDER), wild_session_ids),
    received_tokens=mostly(st.integers(0, MAX_NEW_TOKENS_LIMIT), st.integers(0, 2**32 - 1)),
    received_chars=mostly(st.integers(0, 6), st.integers(0, 2**32 - 1)),
)
def test_fuzzed_resume_requests_get_a_clear_status_and_disturb_nobody(
    stubs, storm, session_id, received_tokens, received_chars
):
    """Resumes of the finished bystander (which read it and must not touch it) and of ids
    that name nothing, claiming any count of tokens and characters received."""
    request = pb.ResumeRequest(session_id=session_id, received_tokens=received_tokens, received_chars=received_chars)
    record(storm, lambda: list(stubs["coordinator"].Resume(request, timeout=30)))


@settings(max_examples=100, **FUZZ)
@given(session_id=wild_session_ids.filter(lambda s: s != BYSTANDER))
def test_fuzzed_delete_requests_get_a_clear_status_and_disturb_nobody(stubs, storm, session_id):
    """Deletes of ids that name no session, or could not name one: deleted=False or
    INVALID_ARGUMENT, and the bystander and the running watcher untouched."""
    request = pb.DeleteRequest(session_id=session_id)
    record(storm, lambda: stubs["coordinator"].Delete(request, timeout=30))


@settings(max_examples=250, **FUZZ)
@given(data=st.data())
def test_fuzzed_propose_requests_get_a_clear_status_and_disturb_nobody(stubs, storm, committed, data):
    request = data.draw(propose_requests(committed))
    record(storm, lambda: list(stubs["draft"].Propose(request, timeout=30)))


@settings(max_examples=300, **FUZZ)
@given(data=st.data())
def test_fuzzed_verify_requests_get_a_clear_status_and_disturb_nobody(stubs, storm, committed, data):
    request = data.draw(verify_requests(committed))
    record(storm, lambda: stubs["target"].Verify(request, timeout=30))


def test_an_ngram_stop_outside_its_bounds_is_an_invalid_argument_that_says_them(stubs, committed):
    request = pb.VerifyRequest(session_id=BYSTANDER, position=len(committed) - 1, new_tokens=committed[-1:],
                               sampling=pb.SamplingParams(temperature=0.0, seed=1), steps=3,
                               stop_at_ngram=pb.NgramStop(min_ngram=3, max_ngram=2))  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        stubs["target"].Verify(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_ngram <= max_ngram" in info.value.details()


RPCS = [
    ("Coordinator", "Generate", True), ("Coordinator", "Resume", True), ("Coordinator", "Info", False),
    ("Coordinator", "Delete", False),
    ("Draft", "Propose", True), ("Draft", "Release", False), ("Draft", "ModelInfo", False),
    ("Target", "Verify", False), ("Target", "Release", False), ("Target", "ModelInfo", False),
]  # fmt: skip


@settings(max_examples=250, **FUZZ)
@given(rpc=st.sampled_from(RPCS), payload=wire_garbage(), release_id=st.one_of(st.just(BYSTANDER), wild_session_ids))
def test_bytes_that_are_not_the_request_message_get_invalid_argument_at_every_rpc(stack, storm, rpc, payload, release_id):
    service, method, streaming = rpc
    port = stack.ports[service.lower()]
    metadata = () if service == "Coordinator" else stack.internal_metadata
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(f"/specdec.v1.{service}/{method}", request_serializer=None, response_deserializer=None)
        record(storm, lambda: call(payload, timeout=30, metadata=metadata))
        if method == "Release":  # a well-formed Release of any id, the bystander's included
            stub = internal_stub(stack, service.lower())
            record(storm, lambda: stub.Release(pb.ReleaseRequest(session_id=release_id), timeout=30))
    finally:
        channel.close()


def test_a_truncated_message_is_an_invalid_argument_that_names_the_message(stack):
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}")
    call = channel.unary_unary("/specdec.v1.Target/Verify", request_serializer=None, response_deserializer=None)
    whole = pb.VerifyRequest(session_id="abc", new_tokens=[1, 2, 3]).SerializeToString()
    with pytest.raises(grpc.RpcError) as info:
        call(whole[:-2], timeout=10, metadata=stack.internal_metadata)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "specdec.v1.VerifyRequest" in info.value.details()
    channel.close()


# ---------------------------------------------------------------- limits


def code_of(call):
    with pytest.raises(specdec.SpecdecClientError) as info:
        call()
    return info.value.code, info.value.message


def test_prompts_over_the_token_limit_are_resource_exhausted(client):
    ids = [5] * (MAX_PROMPT_TOKENS + 1)
    code, message = code_of(lambda: client.generate(prompt_token_ids=ids, max_new_tokens=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"at most {MAX_PROMPT_TOKENS}" in message
    code, message = code_of(lambda: client.generate("x" * 5000, max_new_tokens=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "characters" in message
    assert len(client.generate(prompt_token_ids=ids[:-1], max_new_tokens=2, ignore_eos=True).token_ids) == 2


@pytest.mark.parametrize("session_id", ["ünï", "日本語 セッション", "50%-done", "x%C3%BC", " padded id "])
def test_a_session_id_of_any_printable_text_is_served_by_generate_resume_and_delete(client, session_id):
    """The coordinator's response header names the session; a header is ASCII, so an id outside
    it used to end the call INTERNAL ("Invalid metadata") after its session was created."""
    result = client.generate(PROMPT, max_new_tokens=3, ignore_eos=True, session_id=session_id)
    assert result.session_id == session_id and len(result.token_ids) == 3
    assert client.resume(session_id, received_tokens=1).token_ids == result.token_ids[1:]
    assert client.delete(session_id) is True and client.delete(session_id) is False


@pytest.mark.parametrize("key, says", [("{conv}", "affinity_key may not contain braces"),
                                       ("c" * 129, "affinity_key is 129 characters; the limit is 128")])
def test_an_affinity_key_that_is_no_session_id_is_refused_and_a_good_one_served(client, key, says):
    """An affinity key follows the session id's rules (it picks replicas as an id does)."""
    code, message = code_of(lambda: client.generate(PROMPT, max_new_tokens=2, affinity_key=key))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and says in message
    assert len(client.generate(PROMPT, max_new_tokens=2, ignore_eos=True, affinity_key="日本 conv").token_ids) == 2


def test_max_new_tokens_over_the_limit_is_resource_exhausted(client):
    code, message = code_of(lambda: client.generate(PROMPT, max_new_tokens=MAX_NEW_TOKENS_LIMIT + 1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"at most {MAX_NEW_TOKENS_LIMIT}" in message


def test_a_request_that_sets_no_max_new_tokens_gets_the_coordinators_default_from_the_sdk_and_the_cli(stack, client):
    """This coordinator's default is 4 and its limit 8. The SDK and `specdec generate` always
    sent max_new_tokens (64 unless given), so the coordinator's --default-max-new-tokens never
    applied to them, and below a limit of 64 a call that set nothing was refused
    RESOURCE_EXHAUSTED ("max_new_tokens is 64; this server allows at most 8")."""
    import json
    import subprocess
    import sys

    assert len(client.generate(PROMPT, ignore_eos=True).token_ids) == 4
    cli = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--address", stack.address, "--json", PROMPT],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["stats"]["generated_tokens"] <= 4


def test_requests_beyond_the_concurrency_limit_are_refused_at_once_and_the_running_ones_finish(stack, reference):
    """Freeze the target (SIGSTOP) so four requests stay in flight; a fifth is refused
    with RESOURCE_EXHAUSTED at once; thawed, the four finish with the reference output."""
    import signal

    expected, options, _, _ = reference
    results = []

    def run():
        with specdec.Client(stack.address) as c:
            results.append(c.generate(PROMPT, **options).token_ids)

    target = stack.processes["target"]
    target.send_signal(signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # all four are now waiting on the frozen target
        with specdec.Client(stack.address) as c:
            started = time.monotonic()
            code, message = code_of(lambda: c.generate(PROMPT, max_new_tokens=2))
            assert time.monotonic() - started < 5.0
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4 requests are running" in message
    finally:
        target.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(timeout=60)
    assert results == [expected] * 4


def test_kv_cache_memory_limit_evicts_idle_sessions_and_keeps_the_output(redis_url, tiny_models):
    """A target allowed ~100 tokens of KV cache serves two concurrent ~70-token requests:
    idle sessions are evicted between cycles and rebuilt from Redis, the output is the
    one an unlimited target gives, and the target reports the evictions."""
    import concurrent.futures

    limit_mb = 100 * 1024 / 2**20  # the tiny target's cache is 1 KiB a token
    limited = start_stack(redis_url, tiny_models.target, tiny_models.draft,
                          target_args=["--max-cache-mb", f"{limit_mb:.6f}"])  # fmt: skip
    try:
        options = dict(max_new_tokens=60, ignore_eos=True, num_speculative_tokens=3)
        with specdec.Client(limited.address) as c:
            alone = c.generate(PROMPT, **options).token_ids
        with concurrent.futures.ThreadPoolExecutor(2) as pool:

            def run(_):
                with specdec.Client(limited.address) as c:
                    return c.generate(PROMPT, **options).token_ids

            outputs = list(pool.map(run, range(4)))
        assert outputs == [alone] * 4
        info = internal_stub(limited, "target").ModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert info.cache_evictions > 0 and info.cache_bytes <= limit_mb * 2**20
    finally:
        limited.stop()
