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


def test_ticks_stamp_the_perf_counter(monkeypatch):
    """Each tick stamps the clock the worker reads; on a clock the test moves (iterations of
    10 s, 30 s, 20 s, 20 s, 20 s) the period is their steady median, exactly."""
    from types import SimpleNamespace

    import engine.iteration_clock

    now = [100.0]
    monkeypatch.setattr(engine.iteration_clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    clock = IterationClock()
    for gap in (10.0, 30.0, 20.0, 20.0, 20.0):
        now[0] += gap
        clock.tick()
    assert clock.ends == [110.0, 140.0, 160.0, 180.0, 200.0]
    assert clock.period_s() == 20.0
