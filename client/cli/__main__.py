"""``python -m towerd.client.cli``: the same as ``towerctl``."""

from towerd.client.entry import main

main()
