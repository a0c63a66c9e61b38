"""`yggdrasil models`: the offline default models and whether they are installed."""

from __future__ import annotations


def add_parser(sub) -> None:
    sub.add_parser("models", help="list the offline default models and whether they are installed")


def main(args) -> int:
    from yggdrasil.models.catalog import format_model_table, model_statuses

    print(format_model_table(model_statuses()))
    return 0
