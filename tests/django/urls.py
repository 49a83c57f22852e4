"""The test project's URLconf: the admin (for its login page) and keyexpiry's dashboard."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("keyexpiry/", include("keyexpiry.django.urls")),
]
