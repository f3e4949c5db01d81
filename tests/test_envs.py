"""Tool-call formats, the tool runner (errors, timeouts, counters), step_all, the ``tool`` and
``guess_number`` environments end to end with scripted model turns, traces and config checks."""
import threading
import time

import pytest

from rljax import data
from rljax.envs import (StepResult, Tool, ToolCall, ToolCallError, ToolError, call_tool,
                        check_env_config, env_metrics, env_names, get_tool_format, guess_trace,
                        make_env, make_tool, merge_counters, step_all, trace_messages)
from rljax.envs.runner import check_arguments
from rljax.errors import ConfigError

JSON, PLAIN = get_tool_format("json"), get_tool_format("plain")


# ----------------------------------------------------------------------------- formats

def test_json_format_parses_calls_and_ignores_surrounding_text():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
            '</tool_call> and <tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}'
            '\n</tool_call>')
    assert JSON.parse(text) == [ToolCall("calculator", {"expression": "1+2"}),
                                ToolCall("search", {"query": "x"})]
    assert JSON.parse("The answer is 3.") == []
    assert JSON.call_end == "</tool_call>"


@pytest.mark.parametrize("text,message", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"</tool_call>',
     "malformed JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "arguments must be"),
    ('<tool_call>{"name": "calculator", "arguments": "nope"}</tool_call>', "not JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {}}', "unterminated"),
])
def test_json_format_malformed_calls_are_errors_not_exceptions(text, message):
    (parsed,) = JSON.parse(text)
    assert isinstance(parsed, ToolCallError) and message in parsed.message


def test_pathological_json_is_a_malformed_call():
    deep = "[" * 100_000 + "]" * 100_000
    (parsed,) = JSON.parse(f"<tool_call>{deep}</tool_call>")
    assert isinstance(parsed, ToolCallError)
    (parsed,) = JSON.parse('<tool_call>{"name": "t", "arguments": "' + "[" * 100_000 + '"}</tool_call>')
    assert isinstance(parsed, ToolCallError)
    nested = '{"a":' * 50_000 + "1" + "}" * 50_000  # not JSON we can read: raw text
    assert PLAIN.parse(f"<call python>{nested}</call>") == [ToolCall("python", {}, raw=nested)]


def test_plain_format_raw_and_json_arguments():
    assert PLAIN.parse("<call calculator>123*456</call>") == [
        ToolCall("calculator", {}, raw="123*456")]
    assert PLAIN.parse('x <call search>{"query": "Rome", "k": 1}</call>') == [
        ToolCall("search", {"query": "Rome", "k": 1})]
    assert PLAIN.parse("<call python>{1, 2}</call>") == [ToolCall("python", {}, raw="{1, 2}")]
    assert PLAIN.parse("12*34=408") == []
    assert isinstance(PLAIN.parse("<call calc ulator>1</call>")[0], ToolCallError)
    assert isinstance(PLAIN.parse("<call calculator>1+1")[0], ToolCallError)
    assert PLAIN.call_end == "</call>"


@pytest.mark.parametrize("fmt", [JSON, PLAIN])
def test_render_call_round_trips_through_parse(fmt):
    for call in (ToolCall("calculator", {"expression": "123*456"}),
                 ToolCall("search", {"query": "capital of Kalo", "k": 2})):
        (parsed,) = fmt.parse(fmt.render_call(call))
        tool = make_tool(call.name)
        from rljax.envs.runner import bind_arguments
        assert bind_arguments(tool, parsed) == call.arguments
        assert fmt.render_call(call).endswith(fmt.call_end)


def test_render_results():
    assert JSON.render_results(["408", "x"]) == [{"role": "tool", "content": "408"},
                                                 {"role": "tool", "content": "x"}]
    assert PLAIN.render_results(["408"]) == [{"role": "tool", "content": "<result>408</result>"}]
    with pytest.raises(KeyError, match="known: json, plain"):
        get_tool_format("xml")


# ----------------------------------------------------------------------------- runner

def _tool(fn, name="t", timeout_s=5.0, params=None):
    return Tool(name, "test tool", params or {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}, fn, timeout_s)


def test_call_tool_success_and_counters():
    text, counters = call_tool([make_tool("calculator")], ToolCall("calculator", {}, raw="12*34"))
    assert text == "408"
    assert counters == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool:calculator": 1}


@pytest.mark.parametrize("call,expected", [
    (ToolCallError("malformed JSON in tool call: x"), "Error: malformed JSON"),
    (ToolCall("nope", {"x": 1}), "Error: unknown tool 'nope'; available: calculator, t"),
    (ToolCall("t", {}), "Error: tool 't': missing required argument(s) ['x']"),
    (ToolCall("t", {"x": "1"}), "Error: tool 't': argument 'x' must be integer, got string"),
    (ToolCall("t", {"x": True}), "Error: tool 't': argument 'x' must be integer, got boolean"),
    (ToolCall("t", {"x": 1, "y": 2}), "Error: tool 't': unknown argument(s) ['y']"),
    (ToolCall("t", {"x": -1}), "Error: ValueError: negative"),
    (ToolCall("t", {"x": -2}), "Error: not allowed"),
    (ToolCall("calculator", {}, raw="__import__('os')"), "Error: not allowed in arithmetic"),
])
def test_call_tool_turns_every_failure_into_a_counted_error_observation(call, expected):
    def fn(x):
        if x == -1:
            raise ValueError("negative")
        if x == -2:
            raise ToolError("not allowed")
        return str(x)
    text, counters = call_tool([make_tool("calculator"), _tool(fn)], call)
    assert text.startswith(expected)
    assert counters["tool_calls"] == 1 and counters["tool_errors"] == 1
    assert counters["tool_timeouts"] == 0


def test_call_tool_survives_system_exit():
    text, counters = call_tool(_tool(lambda x: exit(3)), ToolCall("t", {"x": 1}))
    assert text.startswith("Error: SystemExit") and counters["tool_errors"] == 1


def test_keyboard_interrupt_is_not_swallowed():
    def interrupted(x):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        call_tool(_tool(interrupted, timeout_s=0), ToolCall("t", {"x": 1}))


def test_a_hanging_tool_times_out_and_is_counted():
    release = threading.Event()
    hang = _tool(lambda x: release.wait(60) and "late", timeout_s=0.3)
    started = time.monotonic()
    text, counters = call_tool(hang, ToolCall("t", {"x": 1}))
    elapsed = time.monotonic() - started
    release.set()
    assert text == "Error: tool 't' timed out after 0.3s"
    assert counters == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 1, "tool:t": 1}
    assert 0.3 <= elapsed < 5


def test_python_tool_timeout_counts_as_timeout():
    text, counters = call_tool(make_tool("python", wall_s=1),
                               ToolCall("python", {"code": "import time; time.sleep(30)"}))
    assert "killed after 1s wall-clock" in text and counters["tool_timeouts"] == 1


def test_long_observations_are_cut():
    text, _ = call_tool(_tool(lambda x: "z" * 10_000), ToolCall("t", {"x": 1}))
    assert len(text) < 4100 and text.endswith("chars cut]")


def test_check_arguments_schema_subset():
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "m": {"enum": ["a", "b"]},
                                               "s": {"type": ["string", "null"]}}}
    assert check_arguments(schema, {"n": 1.5, "m": "a", "s": None}) is None
    assert check_arguments(schema, {"n": 2}) is None
    assert "one of" in check_arguments(schema, {"m": "c"})
    assert "must be number" in check_arguments(schema, {"n": "2"})
    assert "must be integer, got number" in check_arguments(
        {"properties": {"k": {"type": "integer"}}}, {"k": 3.0})


def test_merge_counters_and_env_metrics():
    assert merge_counters({"a": 1, "b": 2}, {"a": 3}) == {"a": 4, "b": 2}
    episodes = [{"tool_calls": 3, "tool_errors": 1, "tool_timeouts": 0, "tool:python": 3},
                {"tool_calls": 0, "solved": 1}, {"tool_calls": 1, "tool:calculator": 1}]
    assert env_metrics(episodes) == {
        "env/tool_calls_mean": 4 / 3, "env/tool_errors": 1.0, "env/tool_timeouts": 0.0,
        "env/tool:python": 3.0, "env/tool:calculator": 1.0, "env/solved_mean": 1 / 3,
        "env/tool_error_rate": 1 / 4}
    assert env_metrics([]) == {}
    assert "env/tool_error_rate" not in env_metrics([{"tool_calls": 0, "tool_errors": 0}])


# ----------------------------------------------------------------------------- step_all

class _SleepEnv:
    def __init__(self, tag, sleep_s):
        self.tag, self.sleep_s = tag, sleep_s

    def reset(self):
        return []

    def step(self, turn):
        time.sleep(self.sleep_s)
        return StepResult((), float(self.tag), True, {"turn": turn})


def test_step_all_preserves_order_skips_finished_and_runs_concurrently():
    sleep_s = 0.5
    envs = [_SleepEnv(i, sleep_s * (1 if i % 2 else 0.2)) for i in range(8)]
    turns = [f"turn{i}" for i in range(8)]
    turns[5] = None  # a finished episode
    started = time.monotonic()
    results = step_all(envs, turns)
    elapsed = time.monotonic() - started
    assert results[5] is None
    assert [r.reward for i, r in enumerate(results) if i != 5] == [0, 1, 2, 3, 4, 6, 7]
    assert [r.info["turn"] for i, r in enumerate(results) if i != 5] == [
        t for t in turns if t is not None]
    assert elapsed < 3 * sleep_s  # serially: 3 * 0.5 + 4 * 0.1 = 1.9 s


def test_step_all_runs_python_tools_in_parallel():
    env_kwargs = dict(tools=("python",), tool_format="plain")
    envs = [make_env("tool", {"prompt": "p"}, **env_kwargs) for _ in range(4)]
    for env in envs:
        env.reset()
    code = "import time\ntime.sleep(1.0)\nprint('done')"
    started = time.monotonic()
    results = step_all(envs, [f"<call python>{code}</call>"] * 4)
    elapsed = time.monotonic() - started
    assert [r.observation for r in results] == [[{"role": "tool", "content": "<result>done\n</result>"}]] * 4
    assert elapsed < 3.0  # 4 x 1 s sleeping children; serially it would be > 4 s


def test_step_all_names_the_episode_of_a_broken_environment():
    class Broken(_SleepEnv):
        def step(self, turn):
            raise KeyError("bug")
    with pytest.raises(RuntimeError, match="episode 1 "):
        step_all([_SleepEnv(0, 0), Broken(1, 0)], ["a", "b"])


# ----------------------------------------------------------------------------- ToolEnv

@pytest.mark.parametrize("fmt,call", [
    ("plain", "<call calculator>123*456</call>"),
    ("json", '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'),
])
def test_tool_env_episode_with_scripted_turns(fmt, call):
    env = make_env("tool", {"prompt": "123*456=", "answer": "56088"}, tools=("calculator",),
                   tool_format=fmt, system_prompt="Be brief.")
    first = env.reset()
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"] == "123*456="
    assert first[0]["content"].startswith("Be brief.") and "calculator" in first[0]["content"]
    r = env.step("I will use the tool. " + call)
    assert not r.done and r.reward == 0.0
    assert r.observation == get_tool_format(fmt).render_results(["56088"])
    assert r.info == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool:calculator": 1}
    r = env.step("<call nope>1</call>" if fmt == "plain" else "<tool_call>{bad</tool_call>")
    assert not r.done and r.info["tool_errors"] == 1
    assert r.observation[0]["content"].count("Error:") == 1
    r = env.step("56088")
    assert r.done and r.reward == 0.0 and r.observation == ()
    assert env.counters["tool_calls"] == 2 and env.counters["tool_errors"] == 1


def test_tool_env_without_tool_descriptions_and_schemas():
    env = make_env("tool", {"question": "1+1="}, tools=("calculator", "search"),
                   describe_tools=False)
    assert env.reset() == [{"role": "user", "content": "1+1="}]
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["calculator", "search"]


def test_tool_env_max_tool_calls():
    env = make_env("tool", {"prompt": "p"}, tool_format="plain", max_tool_calls=1)
    env.reset()
    assert env.step("<call calculator>1+1</call>").observation[0]["content"] == "<result>2</result>"
    r = env.step("<call calculator>2+2</call>")
    assert "limit (1) reached" in r.observation[0]["content"] and r.info["tool_errors"] == 1


def test_tool_env_call_reward_pays_the_first_call_that_runs_once():
    env = make_env("tool", {"prompt": "p"}, tool_format="plain", call_reward=0.25)
    env.reset()
    assert env.step("<call calculator>1+</call>").reward == 0.0       # a failed call: nothing
    assert env.step("<call calculator>1+1</call>").reward == 0.25     # the first that runs
    assert env.step("<call calculator>2+2</call>").reward == 0.0      # paid once an episode
    assert env.step("2").reward == 0.0                                # the answer: reward fns
    env.reset()                                                       # a new episode pays again
    assert env.step("<call calculator>3*3</call>").reward == 0.25
    assert make_env("tool", {"prompt": "p"}, tool_format="plain").step(
        "<call calculator>1+1</call>").reward == 0.0                  # off by default
    with pytest.raises(ValueError, match="call_reward must be in"):
        make_env("tool", {"prompt": "p"}, call_reward=1.0)


def test_tool_env_passes_tool_kwargs():
    env = make_env("tool", {"prompt": "p"}, tools=("search",), tool_format="plain",
                   tool_kwargs={"search": {"docs": ["alpha beta", "gamma delta"], "k": 1}})
    env.reset()
    assert env.step("<call search>gamma</call>").observation[0]["content"] == \
        "<result>[1] gamma delta</result>"


def test_tools_are_built_once_and_shared_by_episodes(monkeypatch):
    from rljax.envs import base
    from rljax.envs.tool_env import shared_tool
    a = make_env("tool", {"prompt": "p"}, tools=("search",), tool_kwargs={"search": {"k": 2}})
    b = make_env("tool", {"prompt": "q"}, tools=("search",), tool_kwargs={"search": {"k": 2}})
    c = make_env("tool", {"prompt": "q"}, tools=("search",), tool_kwargs={"search": {"k": 1}})
    assert a.tools[0] is b.tools[0] and a.tools[0] is not c.tools[0]
    monkeypatch.setattr(base, "_TOOLS", dict(base._TOOLS))
    base.register_tool("search", lambda **kw: _tool(lambda x: "new", name="search"))
    assert shared_tool("search", k=2).fn(x=1) == "new"  # a re-registered name builds anew


@pytest.mark.parametrize("fmt", ["json", "plain"])
def test_trace_messages_for_multi_digit_arithmetic(fmt):
    task = data.ArithmeticTask(digits=3, operands=2, ops="*")
    for i in range(5):
        ex = task.example(i)
        msgs = trace_messages(ex, fmt, describe_tools=False)
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert msgs[0]["content"] == ex["question"] and msgs[3]["content"] == ex["answer"]
        (call,) = get_tool_format(fmt).parse(msgs[1]["content"])
        assert call.name == "calculator"
        assert msgs[2] == get_tool_format(fmt).render_results([ex["answer"]])[0]
    assert trace_messages({"question": "12*34=", "answer": "408"}, "plain")[0]["role"] == "system"
    with pytest.raises(ValueError, match="not the answer"):
        trace_messages({"question": "12*34=", "answer": "409"}, "plain")


# ----------------------------------------------------------------------------- guess_number

def test_guess_number_episode_with_scripted_turns():
    env = make_env("guess_number", {"prompt": "Guess my number from 1 to 100.", "secret": 37},
                   turn_penalty=0.1)
    assert env.reset() == [{"role": "user", "content": "Guess my number from 1 to 100."}]
    steps = [env.step(t) for t in ("50", "I think 25", "no idea", "37")]
    assert [s.observation for s in steps[:3]] == [[{"role": "user", "content": "lower"}],
                                                   [{"role": "user", "content": "higher"}],
                                                   [{"role": "user", "content": "Answer with a number."}]]
    assert [s.done for s in steps] == [False, False, False, True]
    assert steps[-1].reward == pytest.approx(0.7) and steps[-1].info["solved"] == 1
    assert sum(s.info["invalid_guesses"] for s in steps) == 1


def test_guess_number_hint_format_and_its_trace():
    env = make_env("guess_number", {"prompt": "g", "secret": 70}, hint_format=" {hint}\n")
    env.reset()
    assert env.step("50").observation == [{"role": "user", "content": " higher\n"}]
    msgs = guess_trace({"prompt": "g", "secret": 70, "low": 1, "high": 100},
                       hint_format=" {hint}\n")
    assert "".join(m["content"] for m in msgs) == "g50 higher\n75 lower\n62 higher\n68 higher\n" \
        "71 lower\n69 higher\n70"
    with pytest.raises(ValueError, match="hint_format"):
        make_env("guess_number", {"secret": 1}, hint_format="x")


def test_guess_number_survives_absurd_guesses():
    from rljax.envs.games import parse_guess
    assert parse_guess("I say 12, no, -7!") == -7 and parse_guess("none") is None
    env = make_env("guess_number", {"prompt": "g", "secret": 5})
    env.reset()
    assert env.step("9" * 10_000).observation[0]["content"] == "lower"
    assert env.step("-" + "9" * 10_000).observation[0]["content"] == "higher"


def test_guess_number_max_guesses_ends_the_game_unsolved():
    env = make_env("guess_number", {"prompt": "g", "secret": 3}, max_guesses=2)
    env.reset()
    assert not env.step("1").done
    r = env.step("2")
    assert r.done and r.reward == 0.0 and r.info["solved"] == 0


def test_guess_number_task_and_bisection_trace():
    task = data.GuessNumberTask(low=1, high=32, seed=0)
    train = {task.example(i)["secret"] for i in range(300)}
    held_out = {task.example(i, "eval")["secret"] for i in range(100)}
    assert not train & held_out and train | held_out <= set(range(1, 33))
    assert task.example(7) == task.example(7)  # a pure function of the index
    for i in range(20):
        ex = task.example(i)
        msgs = guess_trace(ex)
        guesses = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert guesses[0] == task.solution(ex) == "16"
        assert guesses[-1] == str(ex["secret"]) and len(guesses) <= 6  # ceil(log2(32)) + 1
    turns = [sum(m["role"] == "assistant" for m in guess_trace(
        {"prompt": "g", "secret": s, "low": 1, "high": 100})) for s in range(1, 101)]
    assert (sum(turns) / 100, max(turns)) == (5.8, 7)  # the numbers docs/agents.md quotes
    source = data.make_source({"source": "guess_number", "low": 1, "high": 32}, "eval")
    assert source[0]["secret"] in held_out


def test_noisy_guess_trace_still_solves_in_consistent_guesses():
    """With ``noise``, random guesses stay inside the interval the hints leave (never a repeat,
    never contradicting a hint) and the game still ends solved; noise 0 is the bisection."""
    import numpy as np
    rng = np.random.default_rng(0)
    turns = []
    for secret in range(1, 101):
        ex = {"prompt": "g", "secret": secret, "low": 1, "high": 100}
        msgs = guess_trace(ex, noise=0.5, rng=rng)
        low, high = 1, 100
        guesses = [int(m["content"]) for m in msgs if m["role"] == "assistant"]
        for guess in guesses[:-1]:
            assert low <= guess <= high and guess != secret
            low, high = (guess + 1, high) if secret > guess else (low, guess - 1)
        assert guesses[-1] == secret and low <= secret <= high
        turns.append(len(guesses))
        assert guess_trace(ex, noise=0.0) == guess_trace(ex)
    assert 5.8 < sum(turns) / 100 < 8  # more guesses than bisection's 5.8, bounded
    with pytest.raises(ValueError, match="needs an rng"):
        guess_trace({"prompt": "g", "secret": 3}, noise=0.5)
    with pytest.raises(ValueError, match="noise must be in"):
        guess_trace({"prompt": "g", "secret": 3}, noise=1.5, rng=rng)


# ----------------------------------------------------------------------------- config checks

def test_check_env_config_names_the_key_and_the_known_names():
    check_env_config("tool", ("calculator", "python"), "json", 3)
    check_env_config("guess_number")
    for kwargs, message in [
        (dict(name="tool", tools=("calc",)), "env.tools: unknown tool 'calc'; known: calculator, "
                                             "python, search"),
        (dict(name="tool", tools="calculator"), "env.tools: expected a list"),
        (dict(name="tool", tools=("search", "search")), "env.tools: a tool is named twice"),
        (dict(name="tool", tool_format="xml"), "env.tool_format: unknown tool format 'xml'"),
        (dict(name="tool", max_tool_calls=-1), "env.max_tool_calls: must be"),
    ]:
        with pytest.raises(ConfigError) as info:
            check_env_config(**kwargs)
        assert str(info.value).startswith(message)


def test_unknown_environment_lists_every_registered_name():
    # Other test modules register environments of their own: compare with the registry.
    with pytest.raises(ConfigError) as info:
        check_env_config(name="tools")
    assert str(info.value).startswith(
        f"env.name: unknown environment 'tools'; known: {', '.join(env_names())}")
    assert {"guess_number", "tool"} <= set(env_names())


USER_CODE = """
from rljax.envs import StepResult, Tool

def make_echo(prefix=">"):
    return Tool("echo", "Echoes its text.", {"type": "object", "properties": {
        "text": {"type": "string"}}, "required": ["text"]}, lambda text: prefix + text)

def not_a_tool():
    return "echo"

class Once:
    def __init__(self, example):
        self.prompt = example["prompt"]
    def reset(self):
        return [{"role": "user", "content": self.prompt}]
    def step(self, turn):
        return StepResult((), float(turn == "ok"), True, {})
"""


def test_user_code_environments_and_tools_by_file_spec(tmp_path):
    from rljax.errors import UserError
    path = tmp_path / "my_envs.py"
    path.write_text(USER_CODE)
    env_spec, tool_spec = f"{path}:Once", f"{path}:make_echo"
    check_env_config(env_spec, (tool_spec,), "plain")
    env = make_env(env_spec, {"prompt": "say ok"})
    assert env.reset() == [{"role": "user", "content": "say ok"}] and env.step("ok").reward == 1.0
    tool_env = make_env("tool", {"prompt": "p"}, tools=(tool_spec,), tool_format="plain",
                        tool_kwargs={tool_spec: {"prefix": "#"}})
    tool_env.reset()
    assert tool_env.step("<call echo>hi</call>").observation[0]["content"] == "<result>#hi</result>"
    with pytest.raises(UserError, match=r"env.name: .*my_envs.py has no 'Twice'"):
        check_env_config(f"{path}:Twice")
    with pytest.raises(UserError, match="env.tools: file not found"):
        check_env_config("tool", (str(tmp_path / "nope.py:make"),))
    with pytest.raises(UserError, match="returned a str, not a Tool"):
        make_tool(f"{path}:not_a_tool")
    with pytest.raises(KeyError, match="unknown tool 'calc'; known: calculator, python, search"):
        make_tool("calc")


# ----------------------------------------------------------------------------- docs

def test_the_docs_example_runs(monkeypatch):
    import os
    import re

    from rljax.envs import base
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "agents.md")
    code = re.search(r"```python\n(.*?)```", open(path).read(), re.DOTALL).group(1)
    # The example registers a tool and an env: keep them out of the shared registries.
    monkeypatch.setattr(base, "_ENVS", dict(base._ENVS))
    monkeypatch.setattr(base, "_TOOLS", dict(base._TOOLS))
    namespace = {}
    exec(compile(code, path, "exec"), namespace)  # its asserts check the outcomes
    assert {"convert", "two_tries"} <= set(base.tool_names()) | set(base.env_names())
    text, counters = call_tool(make_tool("convert"), ToolCall("convert", {
        "value": 1, "source": "km", "target": "km"}))
    assert text == "Error: cannot convert km to km" and counters["tool_errors"] == 1


def test_config_rejects_a_call_reward_that_would_count_a_wrong_answer_correct():
    from rljax.config import default_config
    from rljax.config.reward import check_env
    cfg = default_config()
    cfg.env.name, cfg.env.tools, cfg.env.tool_format = "tool", ("calculator",), "plain"
    cfg.env.kwargs = {"call_reward": 0.2}
    check_env(cfg)
    cfg.env.kwargs = {"call_reward": 1.0}
    with pytest.raises(ConfigError, match=r"^env.kwargs.call_reward: must be a number in \[0, 1\)"):
        check_env(cfg)
