"""Pure allocator arithmetic: size checks, page rounding, the capacity ledger."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings as hsettings

from maasd.allocator.arith import Ledger, check_size, round_up
from maasd.bounds import MAX_BYTES
from maasd.errors import InvalidRequest, MaasdError, PoolExhausted, TooLarge
from strategies import (
    bad_page_sizes,
    bad_sizes,
    ledger_ops,
    page_sizes,
    valid_sizes,
)


class TestCheckSize:
    @pytest.mark.parametrize("size", [1, 4096, MAX_BYTES])
    def test_accepts_positive_ints_below_2_63(self, size):
        assert check_size(size) == size

    @pytest.mark.parametrize("size", [0, -1, -4096, MAX_BYTES + 1, 1 << 64])
    def test_refuses_out_of_range(self, size):
        with pytest.raises(InvalidRequest) as exc:
            check_size(size)
        assert str(size) in exc.value.detail

    @pytest.mark.parametrize("size", [1.0, 4096.0, "4096", b"4096", None, True, False, [4096]])
    def test_refuses_non_int(self, size):
        with pytest.raises(InvalidRequest, match="integer"):
            check_size(size)

    def test_bool_is_named_in_message(self):
        with pytest.raises(InvalidRequest, match="bool"):
            check_size(True)

    @given(bad_sizes)
    def test_every_bad_size_is_invalid_request(self, size):
        with pytest.raises(InvalidRequest):
            check_size(size)

    @given(valid_sizes)
    def test_every_valid_size_passes(self, size):
        assert check_size(size) == size


class TestRoundUp:
    def test_examples(self):
        assert round_up(1, 4096) == 4096
        assert round_up(4096, 4096) == 4096
        assert round_up(4097, 4096) == 8192
        assert round_up(1, 2 << 20) == 2 << 20
        assert round_up((2 << 20) + 1, 2 << 20) == 4 << 20

    @pytest.mark.parametrize("page", [0, -4096, 3, 4095, 6144])
    def test_page_must_be_power_of_two(self, page):
        with pytest.raises(InvalidRequest, match="power of two"):
            round_up(4096, page)

    @pytest.mark.parametrize("size", [0, -1, 1.5, "1", None, True])
    def test_size_is_checked(self, size):
        with pytest.raises(InvalidRequest):
            round_up(size, 4096)

    @given(valid_sizes, page_sizes)
    def test_smallest_page_multiple_not_below(self, size, page):
        ceiling = (size + page - 1) // page * page
        if ceiling > MAX_BYTES:
            with pytest.raises(InvalidRequest, match="2\\^63"):
                round_up(size, page)
            return
        r = round_up(size, page)
        assert r == ceiling
        assert r % page == 0
        assert size <= r < size + page <= r + page

    @given(valid_sizes, page_sizes)
    def test_idempotent(self, size, page):
        if (size + page - 1) // page * page > MAX_BYTES:
            return
        r = round_up(size, page)
        assert round_up(r, page) == r

    @pytest.mark.parametrize("page", [4096, 2 << 20])
    def test_rounding_past_2_63_is_invalid_not_overflow(self, page):
        # 2^63 - 1 itself is a valid size, but no whole number of pages of it fits an off_t.
        with pytest.raises(InvalidRequest, match="2\\^63"):
            round_up(MAX_BYTES, page)
        assert round_up(MAX_BYTES + 1 - page, page) == MAX_BYTES + 1 - page

    @given(bad_page_sizes)
    def test_bad_pages_refused(self, page):
        with pytest.raises(InvalidRequest):
            round_up(1, page)


class TestLedger:
    def test_take_and_give(self):
        led = Ledger(10 * 4096)
        led.take(4096)
        assert (led.used, led.free) == (4096, 9 * 4096)
        led.give(4096)
        assert (led.used, led.free) == (0, 10 * 4096)

    def test_fill_exactly(self):
        led = Ledger(8192)
        led.take(8192)
        assert led.free == 0
        with pytest.raises(PoolExhausted):
            led.take(1)
        assert led.used == 8192

    def test_too_large_is_not_exhausted(self):
        led = Ledger(8192)
        with pytest.raises(TooLarge, match="capacity"):
            led.take(8193)
        assert led.used == 0

    def test_exhausted_changes_nothing(self):
        led = Ledger(8192)
        led.take(4096)
        with pytest.raises(PoolExhausted, match="4096 of 8192 free"):
            led.take(8192)
        assert led.used == 4096

    @pytest.mark.parametrize("size", [-1, 4097])
    def test_underflow_is_a_bug(self, size):
        led = Ledger(8192, used=4096)
        with pytest.raises(AssertionError):
            led.give(size)
        assert led.used == 4096

    def test_error_classes_are_maasd_errors(self):
        assert issubclass(TooLarge, MaasdError)
        assert issubclass(PoolExhausted, MaasdError)
        assert not issubclass(PoolExhausted, TooLarge)

    @hsettings(max_examples=200)
    @given(ledger_ops)
    def test_model(self, ops):
        cap = 1 << 20
        led = Ledger(cap)
        used = 0
        for op, size in ops:
            if op == "take":
                if size <= cap - used:
                    led.take(size)
                    used += size
                else:
                    with pytest.raises((TooLarge, PoolExhausted)):
                        led.take(size)
            else:
                if size <= used:
                    led.give(size)
                    used -= size
                else:
                    with pytest.raises(AssertionError):
                        led.give(size)
            assert led.used == used
            assert led.used + led.free == cap
            assert 0 <= led.used <= cap
