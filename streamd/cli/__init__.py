"""The `streamd` command line: one module per subcommand (`generate`, `serve`, `chat`, `cluster`; `bench` is
`streamd.bench`'s), dispatched by `streamd.cli.main`. `python -m streamd.cli` runs it as the `streamd`
script does. Nothing is imported here, so `python -m streamd.cli.main` finds its module fresh."""
