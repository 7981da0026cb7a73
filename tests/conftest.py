"""Shared fixtures: a real redis-server for the whole run."""

import pytest

from specdec.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server):
    return redis_server.url


# ---------------------------------------------------------------- models

import functools
import urllib.request
from types import SimpleNamespace

import grpc

from specdec.launcher import Stack, StackConfig
from specdec.redis_server import free_port

# Init scale of the tiny models: the default 0.02 gives nearly uniform next-token
# distributions that collapse to one repeated token under greedy decoding; 0.2 gives
# varied text, a top token near 0.3, and two models that overlap ~30% in mass.
TINY_INIT_RANGE = 0.2


def make_tiny_model_dir(tokenizer, directory, *, hidden_size, num_layers, seed, vocab_size=None, noise=0.0):
    """Save a tiny random model; `noise` > 0 perturbs every weight by that fraction of its
    tensor's spread (a noisy copy of the model with the same seed: a draft that partly agrees)."""
    import torch

    from specdec.models import build_tiny_model, save_model

    model = build_tiny_model(
        tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed,
        initializer_range=TINY_INIT_RANGE, vocab_size=vocab_size,
    )  # fmt: skip
    if noise:
        generator = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for weight in model.parameters():
                weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std().clamp_min(1e-3))
    save_model(model, tokenizer, directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """A tiny target and a tiny draft sharing a ~40-token vocabulary. The draft is the target
    with 20% weight noise: TV(p, q) ~0.46, greedy agreement ~0.3, so cycles both accept and reject."""
    from specdec.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    root = tmp_path_factory.mktemp("tiny-models")
    return SimpleNamespace(
        tokenizer=tokenizer,
        target=make_tiny_model_dir(tokenizer, root / "target", hidden_size=64, num_layers=2, seed=1),
        draft=make_tiny_model_dir(tokenizer, root / "draft", hidden_size=64, num_layers=2, seed=1, noise=0.2),
    )


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """This run's own model cache (SPECDEC_CACHE, which every service a test starts inherits):
    it starts empty, so the catalog model is fetched and converted once per run, and the
    user's cache is never read or written."""
    folder = tmp_path_factory.mktemp("specdec-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def smollm2_fetch(model_cache):
    """Fetch and convert the real SmolLM2-135M-Instruct into this run's empty cache, once:
    (its directory, seconds that took)."""
    import time

    from specdec.catalog import is_cached
    from specdec.models import ensure_catalog_model

    assert not is_cached("smollm2-135m-instruct"), "the run's cache starts empty"
    started = time.perf_counter()
    directory = ensure_catalog_model("smollm2-135m-instruct", progress=False)
    return directory, time.perf_counter() - started


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_fetch):
    """The real SmolLM2-135M-Instruct's converted directory (in this run's cache)."""
    return str(smollm2_fetch[0])


def start_stack(redis_url, target, draft, quiet=False, **kw) -> Stack:
    """A stack on loopback (quiet: its services' output goes to files, read by Stack.log_tail)."""
    config = StackConfig(
        port=free_port(), target=target, draft=draft, redis_url=redis_url,
        target_threads=1, draft_threads=1, ready_timeout_s=300, **kw,
    )  # fmt: skip
    return Stack(config, quiet=quiet).start()


@pytest.fixture(scope="session")
def tiny_stack(redis_url, tiny_models):
    """Draft, target and coordinator processes on loopback serving the tiny models, one stack
    for every module that needs no settings of its own (a test that restarts one of its
    services waits until it serves again)."""
    stack = start_stack(redis_url, tiny_models.target, tiny_models.draft)
    yield stack
    stack.stop()


class InternalStub:
    """A stub of a stack's draft or target service (or an added replica of one, by its name)
    that sends the stack's internal token with every call, as the coordinator does."""

    def __init__(self, stack: Stack, name: str):
        credentials = stack.channel_credentials()
        address = f"127.0.0.1:{stack.ports[name]}"
        self.channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
        from specdec.v1 import specdec_pb2_grpc as pb_grpc

        self.stub = {"draft": pb_grpc.DraftStub, "target": pb_grpc.TargetStub}[stack.kind(name)](self.channel)
        self.metadata = stack.internal_metadata

    def __getattr__(self, method: str):
        return functools.partial(getattr(self.stub, method), metadata=self.metadata)


def internal_stub(stack: Stack, name: str) -> InternalStub:
    return InternalStub(stack, name)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A service's /metrics on `port`: (sample name, its labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


# ---------------------------------------------------------------- certificates
# (made in the test: a CA, a leaf for 127.0.0.1/localhost, and a rogue CA with its own leaf)

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def write_pem(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def make_ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return key, cert


def make_leaf(ca_key, ca_cert, name: str, names=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))):
    """A certificate for `names` (127.0.0.1 and localhost), good for servers and clients alike."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    return key, cert


def save_pair(directory, stem, key, cert):
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return (
        write_pem(directory / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM)),
        write_pem(directory / f"{stem}-key.pem", key_pem),
    )


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA with one leaf certificate, and a rogue CA with its own leaf."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = make_ca("specdec test CA")
    rogue_key, rogue_cert = make_ca("rogue CA")
    files = {}
    files["ca"], _ = save_pair(directory, "ca", ca_key, ca_cert)
    files["cert"], files["key"] = save_pair(directory, "leaf", *make_leaf(ca_key, ca_cert, "specdec"))
    files["rogue_ca"], _ = save_pair(directory, "rogue-ca", rogue_key, rogue_cert)
    files["rogue_cert"], files["rogue_key"] = save_pair(directory, "rogue", *make_leaf(rogue_key, rogue_cert, "rogue"))
    return files
