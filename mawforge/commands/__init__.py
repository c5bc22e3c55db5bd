"""The command modules: argparse lives here and in each command's own module, never below."""
