"""flm.log.progress_line: the console line of a logged step."""

from flm.log import progress_line


def test_the_progress_line_names_each_trained_networks_loss():
    metrics = {"loss": 0.01234, "fake_score.loss": 0.5, "discriminator.loss": 1.25, "step_ms": 80.0, "fake_loss": 0.4}
    line = progress_line(10, 100, metrics, elapsed=5.0, eta=45.0)
    assert "| loss 0.0123 | fake_score 0.5000 | discriminator 1.2500 | 80.0 ms/step |" in line
    assert "fake_loss" not in line  # the objective's own figures stay in metrics.jsonl
    alone = progress_line(11, 100, {"fake_score.loss": 0.5}, elapsed=5.0, eta=45.0)  # a window of fake-score steps
    assert "| fake_score 0.5000 |" in alone and "| loss" not in alone


def test_the_progress_line_shows_a_windows_warm_up_apart():
    line = progress_line(50, 100, {"loss": 0.1, "step_ms": 40.0, "warmup_s": 70.3}, elapsed=75.0, eta=2.0)
    assert "| 40.0 ms/step | warm-up 70.3 s |" in line
    assert "warm-up" not in progress_line(100, 100, {"loss": 0.1, "step_ms": 40.0}, elapsed=77.0, eta=0.0)


def test_the_progress_line_says_when_the_steps_replayed_a_cuda_graph():
    graphed = progress_line(50, 100, {"loss": 0.1, "step_ms": 40.0, "cuda_graph": True}, elapsed=5.0, eta=5.0)
    assert "| 40.0 ms/step (CUDA graph) |" in graphed
    eager = progress_line(50, 100, {"loss": 0.1, "step_ms": 40.0, "cuda_graph": False}, elapsed=5.0, eta=5.0)
    assert "| 40.0 ms/step |" in eager
