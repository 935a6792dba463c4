import gc
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")
application = get_wsgi_application()

# As refundops.asgi: what is loaded by now is out of the collector's full passes.
gc.collect()
gc.freeze()
