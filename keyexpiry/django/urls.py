"""`path("keyexpiry/", include("keyexpiry.django.urls"))`: the dashboard, for staff members."""

from django.urls import re_path

from keyexpiry.django.dashboard import dashboard

app_name = "keyexpiry"
urlpatterns = [re_path(r"^(?P<subpath>.*)$", dashboard, name="dashboard")]
