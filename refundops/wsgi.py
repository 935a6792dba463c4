import gc
import os

from django.core.wsgi import get_wsgi_application

from refundops.startup import configuration_errors_in_one_line

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")
with configuration_errors_in_one_line():
    application = get_wsgi_application()

# As refundops.asgi: what is loaded by now is out of the collector's full passes.
gc.collect()
gc.freeze()
