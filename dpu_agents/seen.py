"""The request ids a session admitted: a window of bits, for exactly-once delivery."""

from __future__ import annotations


class SeenIds:
    """The request ids a session admitted, for exactly-once delivery. A client numbers its
    requests in increasing order, so the newest id and one bit for each of the `span` ids below
    it tell a repeat apart; an id older than that is taken as seen. span / 8 bytes however many
    requests come (a dict of the last 1 M ids was 80 MB)."""

    def __init__(self, span: int) -> None:
        self.span, self.high = span, -1
        self._bits = bytearray(-(-span // 8))

    def add(self, rid: int) -> bool:
        """Remember `rid`; False if it was seen (or is too old to tell)."""
        if rid > self.high:
            self._clear(self.high + 1, rid)  # the ids coming into the window: none seen yet
            self.high = rid
        elif rid <= self.high - self.span:
            return False
        byte, bit = divmod(rid % self.span, 8)
        if self._bits[byte] >> bit & 1:
            return False
        self._bits[byte] |= 1 << bit
        return True

    def add_range(self, first: int, n: int) -> list[bool]:
        """`add` of first .. first+n-1: at once when they are all newer than any seen (a
        client's next frame), else one by one."""
        if first <= self.high or n > self.span:
            return [self.add(rid) for rid in range(first, first + n)]
        last = first + n - 1
        self._clear(self.high + 1, last)
        self.high = last
        start = first % self.span
        self._fill_bits(start, min(start + n, self.span), True)
        self._fill_bits(0, start + n - self.span, True)
        return [True] * n

    def _clear(self, lo: int, hi: int) -> None:
        """Forget the bits of ids lo..hi (their places held ids that fell out of the window)."""
        n = hi - lo + 1
        if n >= self.span:
            self._bits[:] = bytes(len(self._bits))
            return
        start = lo % self.span
        self._clear_bits(start, min(start + n, self.span))
        self._clear_bits(0, start + n - self.span)

    def _clear_bits(self, a: int, b: int) -> None:
        self._fill_bits(a, b, False)

    def _fill_bits(self, a: int, b: int, on: bool) -> None:
        """Bits a .. b-1 set (`on`) or cleared."""
        bits = self._bits
        while a < b and a & 7:
            bits[a >> 3] = bits[a >> 3] | (1 << (a & 7)) if on else bits[a >> 3] & ~(1 << (a & 7))
            a += 1
        while a < b and b & 7:
            b -= 1
            bits[b >> 3] = bits[b >> 3] | (1 << (b & 7)) if on else bits[b >> 3] & ~(1 << (b & 7))
        if a < b:
            bits[a >> 3 : b >> 3] = (b"\xff" if on else b"\x00") * ((b - a) >> 3)
