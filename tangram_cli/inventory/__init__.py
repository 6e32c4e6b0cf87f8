"""Inventory: the YAML file that describes a cluster, checked and resolved into ``Node`` values.

from tangram_cli.inventory import load_inventory, local_default
inv = load_inventory("inventory/example.yaml")      # InventoryError (exit 2) lists every problem
for node in inv.nodes: ...                          # flat, resolved, units as integers
"""

from tangram_cli.inventory.load import (
    Problem,
    load_inventory,
    local_default,
    local_inventory_text,
    to_dict,
    to_json,
)
from tangram_cli.inventory.model import (
    Api,
    Controller,
    Inventory,
    Node,
    Ports,
    Profile,
    Scheduler,
    Service,
    format_cpuset,
    parse_cpuset,
    parse_destination,
    parse_duration_ms,
    parse_size_mib,
)

__all__ = [
    "Api",
    "Controller",
    "Inventory",
    "Node",
    "Ports",
    "Problem",
    "Profile",
    "Scheduler",
    "Service",
    "format_cpuset",
    "load_inventory",
    "local_default",
    "local_inventory_text",
    "parse_cpuset",
    "parse_destination",
    "parse_duration_ms",
    "parse_size_mib",
    "to_dict",
    "to_json",
]
