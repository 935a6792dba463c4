#!/usr/bin/env python
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")
    from django.core.management import execute_from_command_line

    from refundops.startup import configuration_errors_in_one_line

    with configuration_errors_in_one_line():
        execute_from_command_line(sys.argv)
