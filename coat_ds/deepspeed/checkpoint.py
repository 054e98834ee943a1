"""placeholder"""
def install(engine):
    pass
