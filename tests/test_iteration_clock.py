"""The steady-state period a worker reports for each epoch."""
from engine.iteration_clock import IterationClock


def test_period_is_the_median_gap_after_the_warm_up_iterations():
    clock = IterationClock()
    clock.ends = [0.0, 10.0, 13.0, 14.0, 16.0, 18.0]  # the first two iterations are slow
    assert clock.period_s() == 2.0  # gaps 3, 1, 2, 2
    assert clock.period_s(warmup=0) == 2.0  # gaps 10, 3, 1, 2, 2
    assert IterationClock().period_s() == 0.0
    short = IterationClock()
    short.ends = [0.0, 5.0]
    assert short.period_s() == 0.0  # no gap after the warm-up


def test_ticks_measure_real_iterations():
    import time

    clock = IterationClock()
    for _ in range(5):
        time.sleep(0.01)
        clock.tick()
    assert 0.009 < clock.period_s() < 0.1
