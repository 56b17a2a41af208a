"""`--config FILE`: a command's flags from a YAML or JSON file (what `kvserve tune` writes).

The file is a mapping from long flag names, with or without their dashes and with `-` or `_`
(`max-num-seqs: 16`, `max_num_seqs: 16`), to values as they would be written on the command
line; a flag that takes no value (`--ignore-eos`) takes true or false. An engine flag may also
be named by its config field or LLM() keyword (`num_threads` for `--threads`,
`enable_prefix_caching: false` for `no-prefix-caching: true`: the names kvserve.config's
add_engine_args gives each flag's action as `file_names`), so a file maps onto the same fields
as the flags and LLM(**kwargs). A JSON-valued flag (`speculative-config`) may be given as a
mapping. Flags on the command line win over the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="read flags from a YAML file (e.g. the one `kvserve tune` writes); "
        "flags given here win over it",
    )


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parser.parse_args(argv), with the defaults of the --config file's flags replaced by its
    values. A bad file, an unknown flag or a bad value in it ends the program with one line that
    names the file, the flag and the fix (exit status 2, as argparse's own errors)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            parser.set_defaults(**config_defaults(parser, known.config))
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    return parser.parse_args(argv)


def config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """{dest: value} for each flag the file sets, converted and checked as the parser would."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"--config {path} must be a mapping of flag names to values, like 'max-num-seqs: 16'"
        )
    flags = {
        opt[2:]: a
        for a in parser._actions
        for opt in a.option_strings
        if opt.startswith("--") and opt not in ("--config", "--help")
    }
    aliases = {  # other names of a flag (kvserve.config.add_engine_args): {name: (flag, negate)}
        alias: (flag, negate)
        for flag, a in flags.items()
        for alias, negate in getattr(a, "file_names", {}).items()
    }
    out = {}
    for key, value in data.items():
        name = where = str(key).lstrip("-").replace("_", "-")
        negate = False
        if name not in flags and name in aliases:
            name, negate = aliases[name]  # a config field's name: its flag
            where = f"{where} (--{name})"
        action = flags.get(name)
        if action is None:
            close = difflib.get_close_matches(name, list(flags), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"--config {path}: unknown flag {key!r} for this command{hint} "
                f"(see --help for the flags it takes)"
            )
        if negate:
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {where} takes true or false, got {value!r}")
            value = not value
        out[action.dest] = _value(action, value, f"--config {path}: {where}")
    return out


def _value(action: argparse.Action, value, where: str):
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise ValueError(f"{where} takes true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    if value is None:
        raise ValueError(f"{where} has no value")
    text = (
        value
        if isinstance(value, str)
        else json.dumps(value)
        if isinstance(value, bool)
        else str(value)
    )
    try:
        converted = action.type(text) if action.type is not None else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{where}: {e}") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{where}: {converted!r} is not one of {list(action.choices)}")
    return converted
