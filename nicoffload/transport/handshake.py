"""The socket transports' handshake, sender to receiver, over the control Channel:

    sender                                    receiver
    HELLO {transport, nonce_s}           ->
                                         <-   CHALLENGE {nonce_r}      (a receiver with a key)
    AUTH {proof_s}                       ->                            (wrong: ERROR, refused)
                                         <-   WELCOME {ring, proof_r}
    from here on every frame carries a MAC (`integrity`), keyed from the key, both nonces and
    the transcript of the four frames above; then the transport's own ACKs.

A receiver with a key refuses a sender without one; a receiver without a key answers HELLO with
WELCOME at once (and authenticates no one: the frames then carry no MAC).
"""

from __future__ import annotations

import select
import socket
import time

import msgspec

from nicoffload.errors import FrameError, TransportError
from nicoffload.transport.channel import Channel
from nicoffload.transport.frame import (
    Header,
    Hello,
    Kind,
    Welcome,
    decode_meta,
    encode,
    encode_meta,
    error_from_frame,
)
from nicoffload.transport.integrity import (
    KEY_BYTES,
    NONCE_BYTES,
    DataAuth,
    DataChallenge,
    check_proof,
    data_keys,
    nonce,
    receiver_proof,
    sender_proof,
)

Nonces = tuple[bytes, bytes]  # (the sender's, the receiver's)
Rival = tuple[socket.socket, float]  # a listener, and when this connection's handshake began
DISPLACE_AFTER = 0.25  # s into its handshake, a connection not yet proved gives way to a newer


def check_key(key: bytes | None) -> bytes | None:
    if key is not None and (not isinstance(key, bytes) or len(key) < KEY_BYTES):
        raise ValueError(f"a transport key is at least {KEY_BYTES} bytes")
    return key


def read(
    ch: Channel, kinds: tuple[Kind, ...], timeout: float, rival: Rival | None = None
) -> tuple[Kind, bytes]:
    """Read one frame of one of `kinds` within `timeout` s: its kind and metadata. With a
    `rival` (a listener), a connection waiting there first displaces this one."""
    if not _wait(ch, timeout, rival):
        raise TransportError(f"{ch.peer}: no {kinds[0].name} within {timeout} s")
    got = ch.read_head(0)
    if got is None:
        raise TransportError(f"{ch.peer} closed the connection")
    if got[0].kind is Kind.ERROR:
        raise error_from_frame(got[1], ch.peer)
    if got[0].kind is Kind.SHUTDOWN:
        raise TransportError(f"{ch.peer} closed")
    if got[0].kind not in kinds:
        raise FrameError(f"malformed frame: kind: {got[0].kind.name}, expected {kinds[0].name}")
    return got[0].kind, got[1]


def expect(ch: Channel, kind: Kind, timeout: float, rival: Rival | None = None) -> bytes:
    """Read one frame of `kind` (its metadata) within `timeout` s; TransportError otherwise."""
    return read(ch, (kind,), timeout, rival)[1]


def _wait(ch: Channel, timeout: float, rival: Rival | None) -> bool:
    """Whether a frame is there within `timeout` s; TransportError once a newer connection
    waits on the rival listener and this one's handshake is DISPLACE_AFTER s old."""
    if rival is None or ch.readable(0):
        return ch.readable(timeout)
    listener, since = rival
    poll = select.poll()
    for sock in (ch.sock, listener):
        poll.register(sock, select.POLLIN)
    ready = {fd for fd, _ in poll.poll(max(0, int(timeout * 1000)))}
    if ch.sock.fileno() in ready:
        return True
    if not ready:
        return False
    grace = since + DISPLACE_AFTER - time.monotonic()
    if grace > 0 and ch.readable(min(grace, timeout)):
        return True  # a handshake on its way is not cut short by a newcomer
    raise TransportError(f"{ch.peer}: displaced by a newer connection before it proved the key")


def open_sender(ch: Channel, transport: str, key: bytes | None, timeout: float) -> Welcome:
    """The sender's side up to WELCOME; with a key and a receiver that has one, both have
    proved it and the channel is secured."""
    if key is None:
        ch.send(encode(Header(Kind.HELLO), Hello(transport)))
        return decode_meta(expect(ch, Kind.WELCOME, timeout), Welcome)
    ch.record()
    mine = nonce()
    ch.send(encode(Header(Kind.HELLO), Hello(transport, mine)))
    kind, blob = read(ch, (Kind.CHALLENGE, Kind.WELCOME), timeout)
    if kind is Kind.WELCOME:  # a receiver without a key: it authenticates no one
        return decode_meta(blob, Welcome)
    theirs = decode_meta(blob, DataChallenge).nonce
    if len(theirs) != NONCE_BYTES:
        raise FrameError(f"malformed frame: meta: a receiver nonce of {len(theirs)} bytes")
    ch.send(encode(Header(Kind.AUTH), DataAuth(sender_proof(key, mine, theirs))))
    welcome = decode_meta(expect(ch, Kind.WELCOME, timeout), Welcome)
    expected = receiver_proof(key, mine, theirs, _unproven(welcome))
    check_proof(expected, welcome.proof, "receiver")
    to_receiver, to_sender = data_keys(key, mine, theirs, ch.transcript())
    ch.secure(to_receiver, to_sender)
    return welcome


def greet_sender(
    ch: Channel, transport: str, key: bytes | None, timeout: float, listener: socket.socket
) -> Nonces | None:
    """The receiver's side up to its WELCOME: HELLO, and with a key the challenge (a sender
    that does not prove the key is refused: TransportError). The nonces, for `welcome`.

    With a key, a newer connection waiting on `listener` displaces one that has not proved
    the key DISPLACE_AFTER s into its handshake: a stranger who connects first and stalls
    cannot hold the receiver until the real sender's connect times out, and strangers who
    keep connecting cannot cut short a sender that answers promptly."""
    rival = None
    if key is not None:
        ch.record()
        rival = (listener, time.monotonic())
    hello = decode_meta(expect(ch, Kind.HELLO, timeout, rival), Hello)
    if hello.transport != transport:
        raise FrameError(f"a {hello.transport} sender, this is a {transport} ring")
    if key is None:
        return None
    if len(hello.nonce) != NONCE_BYTES:
        raise TransportError("this receiver authenticates its sender: the sender has no key")
    mine = nonce()
    ch.send(encode(Header(Kind.CHALLENGE), DataChallenge(mine)))
    proof = decode_meta(expect(ch, Kind.AUTH, timeout, rival), DataAuth).proof
    check_proof(sender_proof(key, hello.nonce, mine), proof, "sender")
    return hello.nonce, mine


def welcome(ch: Channel, meta: Welcome, key: bytes | None, nonces: Nonces | None) -> None:
    """Send the receiver's WELCOME; after an authenticated greeting, with its proof, and the
    channel secured from then on."""
    if key is None or nonces is None:
        ch.send(encode(Header(Kind.WELCOME), meta))
        return
    proof = receiver_proof(key, *nonces, _unproven(meta))
    ch.send(encode(Header(Kind.WELCOME), msgspec.structs.replace(meta, proof=proof)))
    to_receiver, to_sender = data_keys(key, *nonces, ch.transcript())
    ch.secure(to_sender, to_receiver)


def _unproven(meta: Welcome) -> bytes:
    """What the receiver's proof covers besides the nonces: its WELCOME without the proof."""
    return encode_meta(msgspec.structs.replace(meta, proof=b""))
